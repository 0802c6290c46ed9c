"""`install()`: `import transformers` without reading its whole source tree each time.

Importing transformers walks `transformers/models/` (about 5,200 files in 5.24) and reads the text of
every module in it, to find each one's `__all__` and `@requires` backends (`define_import_structure`),
and it does so twice: for the top-level package and for `transformers.models` (its `lru_cache` is keyed
once by a `Path`, once by a `str`). On this project's 2-core machine that is 0.6 s of a 2.9 s import,
in every process that builds a model: each rank under torchrun, the launcher before it forks.

`install()`, called before transformers is imported, wraps
`define_import_structure(module_path, prefix)` as its module is loaded (another signature is left
alone). The result is kept on disk, as JSON after a first line holding the fingerprint of what it was
computed from (compared before the JSON is parsed; a record of any other shape is a miss): every
path under the walked directory with each file's size and mtime in nanoseconds, and the same of
`import_utils.py` itself (14 ms to take). A file installed, upgraded, edited or removed changes the
fingerprint, and the tree is read again. Where the directory cannot be read or written, transformers
computes the structure as usual.

The cache is `$RESHARD_IMPORT_CACHE_DIR` (`LibrarySettings.import_cache_dir`), else
`$XDG_CACHE_HOME/reshard/imports/` (default `~/.cache/...`): one small JSON file per walked directory
and prefix, replaced atomically. Installed after transformers was imported, `install()` does nothing.

Nothing installs it on import: `import reshard` changes no other library. reshard's own entry points
switch it on (the `reshard` commands, `reshard launch`, `python -m reshard.cli.train`), and a worker of
your own does with `reshard.enable_import_cache()` before it imports transformers (docs/launch.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from reshard.cachedir import cache_dir
from reshard.errors import ReshardError
from reshard.settings import env_name, library_settings

TARGET = "transformers.utils.import_utils"
DIR_ENV = env_name("import_cache_dir")
Structure = dict[frozenset[str], dict[str, set[str]]]


def install() -> None:
    """Cache transformers' import structure from the next `import transformers` on (see the module docstring)."""
    if TARGET not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `import_utils` as the path finder would, and wraps `define_import_structure` once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                original = getattr(module, "define_import_structure", None)
                if callable(original) and list(inspect.signature(original).parameters) == ["module_path", "prefix"]:
                    # an lru_cache as transformers' own: one object per argument
                    wrapped = functools.wraps(original)(functools.partial(cached, original))
                    module.define_import_structure = functools.lru_cache(wrapped)

            loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def cached(original: Callable[..., Structure], module_path: str | os.PathLike[str], prefix: str | None = None) -> Structure:
    """`original(module_path, prefix)` from the cache when the tree it reads is unchanged, else computed and kept."""
    root = os.fspath(module_path)
    root = os.path.dirname(root) if os.path.isfile(root) else root
    try:
        fingerprint = _fingerprint(root, original)
        key = hashlib.blake2b(f"{os.path.realpath(root)}\0{prefix}".encode(), digest_size=12).hexdigest()
        dest = cache_dir("imports", library_settings().import_cache_dir) / f"transformers-{key}.json"
    except (OSError, RuntimeError, KeyError, ReshardError):
        # a bad RESHARD_* value is said by what reads it, not by `import transformers`; no home directory
        # (RuntimeError from Path.home, KeyError from a missing passwd entry) is no cache
        return original(module_path, prefix)
    found = _read(dest, fingerprint)
    if found is not None:
        return found
    result = original(module_path, prefix)
    _keep(dest, fingerprint, result)
    return result


MAX_RECORD = 64 << 20  # transformers 5.24's structure is about 0.5 MB


def _read(dest: Path, fingerprint: str) -> Structure | None:
    """The structure recorded in `dest` for `fingerprint`; None (a miss) for a record that is absent, of
    another fingerprint (compared before anything is parsed), too large, or not exactly the shape `_keep`
    writes, whatever is wrong with it."""
    head = f"{fingerprint}\n".encode()
    try:
        with open(dest, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_RECORD or f.read(len(head)) != head:
                return None
            rec = json.loads(f.read())
        if not isinstance(rec, list):
            return None
        out: Structure = {}
        for backends, modules in rec:
            if not (isinstance(backends, list) and isinstance(modules, dict) and all(map(_is_names, modules.values()))
                    and _is_names(backends)):
                return None
            out[frozenset(backends)] = {str(m): set(names) for m, names in modules.items()}
        return out
    except (OSError, ValueError, TypeError, RecursionError):
        return None


def _is_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _fingerprint(root: str, original: Callable[..., Any]) -> str:
    """Every entry under `root` (but `__pycache__`), with each file's size and mtime, and the code that reads them."""
    h = hashlib.blake2b(digest_size=16)

    def add(path: str) -> None:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())

    def walk(d: str) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.name == "__pycache__":
                continue
            if e.is_dir():
                h.update(f"{e.path}/\n".encode())
                walk(e.path)
            else:
                add(e.path)

    add(inspect.getfile(inspect.unwrap(original)))
    walk(root)
    return h.hexdigest()


def _keep(dest: Path, fingerprint: str, result: Any) -> None:
    """Write the structure next to its fingerprint, atomically; nothing when it is not the expected shape
    or the directory refuses."""
    try:
        structure = [[sorted(backends), {m: sorted(names) for m, names in modules.items()}]
                     for backends, modules in result.items()]
        text = f"{fingerprint}\n" + json.dumps(structure)
    except (AttributeError, TypeError, ValueError):
        return
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, dest)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
