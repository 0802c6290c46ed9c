"""The checkpoints under the root: safe names and paths, parsed headers and plans cached by stat identity.

Nothing outside the root is read or written: names are validated before they touch the file system,
and every directory and file is resolved (symlinks followed) and must stay under the root's real
path. A request re-stats the checkpoint directory (one `scandir`) but re-parses headers only when a
file's name, size, mtime or inode changed. Manifests stored with `PUT .../rules` live in
ROOT/.reshard/rules/NAME/LABEL.json, a directory no checkpoint name can reach. `NAME/optimizer` (`PARTS`)
names the optimizer state of a training checkpoint (ROOT/NAME/optimizer, rank files of its own). A
directory of rank files (and no model.safetensors or index) is served as the checkpoint its rank files
describe (`reshard.io.source.rank_dir.ShardSet`, under the rules they recorded), at any layout; a torch
DCP checkpoint (`.metadata` + `.distcp` files, or HuggingFaceStorageWriter's shard files) as the tensors
it saved (`reshard.io.source.dcp_dir.DcpCheckpoint`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from cachetools import LRUCache

from reshard.errors import ManifestError, NotFoundError, PlanError, RegistryError, ReshardError
from reshard.format.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, Checkpoint, LocalDirectory
from reshard.format.dcp_metadata import METADATA_NAME
from reshard.format.rank_file import OPTIMIZER_DIR
from reshard.gcpause import paused_gc
from reshard.io.outfs import write_json_atomic
from reshard.io.source.dcp_dir import DcpCheckpoint, dcp_kind
from reshard.io.source.opener import checkpoint_manifest
from reshard.io.source.rank_dir import ShardSet, has_rank_files
from reshard.layout.mesh import Layout
from reshard.plan.planner import LayoutPlanner, as_layout, make_plan, make_planner, resolve_rules
from reshard.plan.types import Plan, RankPlan
from reshard.rules.engines import apply_engine
from reshard.rules.manifest import Manifest
from reshard.service.http_errors import BadRequest
from reshard.service.serve_settings import Settings

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_LABEL = "default"
PARTS = (OPTIMIZER_DIR,)  # NAME/PART: a checkpoint inside a checkpoint (a training checkpoint's optimizer state)
_WATCHED = (".safetensors", ".distcp", ".json", ".yaml", ".yml")
_WEIGHTS = (".safetensors", ".distcp")

K = TypeVar("K")
V = TypeVar("V")
StatKey = tuple[tuple[str, int, int, int], ...]
Served = Checkpoint | ShardSet | DcpCheckpoint


def watched(name: str) -> bool:
    """Whether file `name` can shape a checkpoint (weights, JSON and rules files, DCP's `.metadata`)."""
    return name == METADATA_NAME or (not name.startswith(".") and name.endswith(_WATCHED))


class LRU(Generic[K, V]):
    """cachetools' `LRUCache` behind a lock (it is not thread-safe; the catalog is read from worker threads)."""

    def __init__(self, maxsize: int, *, getsizeof: Callable[[V], int] | None = None) -> None:
        self.maxsize = maxsize
        self._data: LRUCache[K, V] = LRUCache(maxsize, getsizeof=getsizeof)
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._data[key] = value

    def __len__(self) -> int:
        return len(self._data)


def valid_name(name: str) -> bool:
    """A checkpoint name or manifest label: `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`, no `..`."""
    return bool(NAME_RE.fullmatch(name)) and ".." not in name


def check_name(name: str, *, what: str = "checkpoint name") -> str:
    """`name` if `valid_name` (a checkpoint name: or `NAME/PART`, PART one of `PARTS`), else 400 with what
    is allowed."""
    base, sep, part = name.partition("/") if isinstance(name, str) and what == "checkpoint name" else (name, "", "")
    if not isinstance(base, str) or not valid_name(base) or (sep and part not in PARTS):
        raise BadRequest(
            f"{what} {name!r} is not allowed: use 1-128 letters, digits, '.', '_', '-', "
            "starting with a letter or digit, without '..' or path separators"
            + (f" (or NAME/{'|'.join(PARTS)})" if what == "checkpoint name" else "")
        )
    return name


def part_name(name: str, part: str | None) -> str:
    """The served name of `part` (one of `PARTS`, None: the checkpoint itself) of checkpoint `name`."""
    return f"{name}/{part}" if part else name


def is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass(frozen=True)
class ServedCheckpoint:
    """A parsed checkpoint and the manifest a request asked for."""

    name: str
    ckpt: Served
    manifest: Manifest
    key: StatKey


@dataclass
class _Entry:
    ckpt: Served
    manifest: Manifest | None = None
    manifest_error: ReshardError | None = None
    resolved: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Catalog:
    """Lookup of checkpoints, manifests and rank plans; lives on `app.state.catalog`."""

    def __init__(self, settings: Settings) -> None:
        self.root = Path(os.path.realpath(settings.root))
        self.rules_dir = settings.state_dir / "rules"
        self._ckpts: LRU[tuple[str, StatKey], _Entry] = LRU(settings.checkpoint_cache)
        # bounded by what the plans hold (their tensor entries), not by their count: one plan of a large
        # checkpoint can be a thousand of a small one
        self._plans: LRU[tuple[Any, ...], tuple[str, RankPlan]] = LRU(settings.plan_cache,
                                                                       getsizeof=lambda hit: len(hit[1].tensors) + 1)
        self.max_plan_work = settings.max_plan_work
        self._planners: LRU[tuple[Any, ...], tuple[str, LayoutPlanner]] = LRU(8)
        self._stored: LRU[tuple[str, int, int], Manifest] = LRU(256)
        self._engines: LRU[tuple[Any, ...], Manifest] = LRU(64)

    # --- paths -------------------------------------------------------------------------------

    def directory(self, name: str, *, create: bool = False) -> Path:
        """The real path of checkpoint `name`; 404 when absent (unless `create`), 400 when it escapes."""
        check_name(name)
        path = self.root / name
        if create and not os.path.lexists(path):
            path.mkdir(exist_ok=True)
        real = Path(os.path.realpath(path))
        if not is_within(real, self.root) or real == self.root:
            raise BadRequest(f"checkpoint {name!r} resolves outside the served root (symlink); refused")
        if not real.is_dir():
            raise NotFoundError(f"no checkpoint named {name!r}; GET /v1/checkpoints lists them")
        return real

    def scan(self, directory: Path) -> StatKey:
        """(name, size, mtime_ns, inode) of every file that can shape the checkpoint; refuse escapes."""
        out = []
        try:
            entries = list(os.scandir(directory))
        except OSError as e:
            raise NotFoundError(f"{directory.name}: cannot list: {e.strerror}") from None
        for entry in entries:
            if not watched(entry.name):
                continue
            if entry.is_symlink() and not is_within(Path(os.path.realpath(entry.path)), self.root):
                raise BadRequest(f"{directory.name}/{entry.name} is a symlink that leaves the served root; refused")
            try:
                st = os.stat(entry.path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(sorted(out))

    def names(self) -> list[dict[str, Any]]:
        """Checkpoint directories under the root (valid names, inside the root, with safetensors files)."""
        found = []
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            if not valid_name(entry.name):
                continue
            try:
                key = self.scan(self.directory(entry.name))
            except ReshardError:
                continue
            weights = [f for f in key if f[0].endswith(_WEIGHTS)]
            if weights:
                found.append({"name": entry.name, "files": len(weights), "bytes": sum(f[1] for f in weights)})
        return found

    # --- checkpoints and manifests -----------------------------------------------------------

    def _entry(self, name: str) -> tuple[_Entry, StatKey]:
        directory = self.directory(name)
        key = self.scan(directory)
        if not any(f[0].endswith(".safetensors") or f[0] == METADATA_NAME for f in key):
            raise NotFoundError(f"checkpoint {name!r} has no .safetensors files (nor a DCP .metadata)")
        entry = self._ckpts.get((name, key))
        if entry is None:
            entry = _Entry(self._open_checkpoint(name, directory, key))
            self._ckpts.put((name, key), entry)
        return entry, key

    def opened(self, name: str) -> tuple[Checkpoint | ShardSet, StatKey]:
        """Checkpoint `name` (or a directory of rank files) parsed, and its stat key, without a manifest:
        what a request that names its own boxes reads (`reshard.plan.box_plan`)."""
        entry, key = self._entry(name)
        return entry.ckpt, key

    def _open_checkpoint(self, name: str, directory: Path, key: StatKey) -> Served:
        names = [f[0] for f in key]
        rank_dir = has_rank_files(names) and SINGLE_NAME not in names and INDEX_NAME not in names
        ckpt: Served = ShardSet.open(directory) if rank_dir else \
            DcpCheckpoint.open(directory) if dcp_kind(LocalDirectory(directory), names) else Checkpoint.open(directory)
        for f in ckpt.files:
            if not is_within(Path(os.path.realpath(f.path)), self.root):
                raise BadRequest(f"{name}/{f.path.name} resolves outside the served root; refused")
        return ckpt

    def _stored_path(self, name: str, label: str) -> Path:
        return self.rules_dir / check_name(name) / f"{check_name(label, what='manifest label')}.json"

    def stored_labels(self, name: str) -> list[str]:
        d = self.rules_dir / check_name(name)
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []

    def stored_manifest(self, name: str, label: str) -> Manifest | None:
        path = self._stored_path(name, label)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        key = (str(path), st.st_size, st.st_mtime_ns)
        manifest = self._stored.get(key)
        if manifest is None:
            try:
                obj = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ManifestError(f"stored manifest {label!r} of {name!r} is unreadable: {e}") from None
            manifest = Manifest.from_dict(obj, source=f"stored manifest {label!r}")
            self._stored.put(key, manifest)
        return manifest

    def source(self, name: str, *, rules: str | None = None, engine: str | None = None) -> ServedCheckpoint:
        """The checkpoint `name` and its manifest: `rules` (a stored label) if given, else the stored
        default, else a rules file in its directory, else its config.json tp_plan; adjusted for an
        `engine` (`reshard.rules.engines`) when one is named."""
        src = self._source(name, *self._entry(name), rules)
        if engine is None:
            return src
        key = (src.name, src.key, src.manifest.digest(), engine)
        manifest = self._engines.get(key)
        if manifest is None:
            manifest = apply_engine(src.manifest, engine, list(src.ckpt.global_tensors()), getattr(src.ckpt, "config", None))
            self._engines.put(key, manifest)
        return dataclasses.replace(src, manifest=manifest)

    def _source(self, name: str, entry: _Entry, key: StatKey, rules: str | None) -> ServedCheckpoint:
        if rules is not None:
            manifest = self.stored_manifest(name, rules)
            if manifest is None:
                raise NotFoundError(f"checkpoint {name!r} has no stored manifest {rules!r}; "
                                    f"stored: {self.stored_labels(name)}")
            return ServedCheckpoint(name, entry.ckpt, manifest, key)
        stored = self.stored_manifest(name, DEFAULT_LABEL)
        if stored is not None:
            return ServedCheckpoint(name, entry.ckpt, stored, key)
        with entry.lock:
            if not entry.resolved:
                try:
                    ckpt = entry.ckpt
                    entry.manifest = ckpt.manifest() if isinstance(ckpt, ShardSet) else checkpoint_manifest(ckpt)
                except ReshardError as e:
                    entry.manifest_error = e
                entry.resolved = True
        if entry.manifest is None:
            assert entry.manifest_error is not None
            raise entry.manifest_error
        return ServedCheckpoint(name, entry.ckpt, entry.manifest, key)

    def describe(self, name: str, *, rules: str | None = None) -> dict[str, Any]:
        """The checkpoint JSON: files, tensors, config and where its manifest comes from."""
        entry, key = self._entry(name)
        rule_info = self._rules_info(name, entry, key, rules)
        ckpt = entry.ckpt
        return {
            "name": name,
            "files": [{"name": f.path.name, "size": f.size, "mtime_ns": f.mtime_ns} for f in ckpt.files],
            "total_bytes": ckpt.total_bytes(),
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "file": _file_of(t)} for t in ckpt.tensors.values()],
            "config": ckpt.config,
            "rules": rule_info,
        }

    def rules_info(self, name: str, *, rules: str | None = None) -> dict[str, Any]:
        """The `rules` part of `describe`: where the manifest comes from, or why none applies."""
        return self._rules_info(name, *self._entry(name), rules)

    def _rules_info(self, name: str, entry: _Entry, key: StatKey, rules: str | None) -> dict[str, Any]:
        try:
            src = self._source(name, entry, key, rules)
            rule_info: dict[str, Any] = {"source": src.manifest.source, "digest": src.manifest.digest(),
                                         "manifest": src.manifest.to_dict(), "error": None}
        except (ManifestError, RegistryError, PlanError) as e:  # the checkpoint is still described
            rule_info = {"source": None, "digest": None, "manifest": None, "error": str(e)}
        rule_info["stored"] = self.stored_labels(name)
        return rule_info

    # --- plans -------------------------------------------------------------------------------

    def check_work(self, src: ServedCheckpoint, layout: Layout, ranks: int, *, what: str) -> None:
        """BadRequest when planning `ranks` ranks of `src` (ranks x tensors) is more than one request may
        cause (`max_plan_work`), naming the smaller requests that fit."""
        count = len(src.ckpt.global_tensors())
        if ranks * count > self.max_plan_work:
            fit = max(1, self.max_plan_work // max(count, 1))
            raise BadRequest(f"{what} of {src.name!r} at {layout.describe()} plans {ranks} ranks x {count} tensors = "
                             f"{ranks * count}, over the {self.max_plan_work} one request may plan; ask for at most "
                             f"{fit} ranks at a time (`ranks`), or one rank's shard")

    def plan(self, src: ServedCheckpoint, layout: Layout | int, *, ranks: list[int] | None = None) -> Plan:
        return make_plan(src.ckpt, src.manifest, layout, ranks=ranks)

    def planner(self, src: ServedCheckpoint, layout: Layout | int) -> tuple[Plan, LayoutPlanner]:
        """The plan of `layout` (no rank planned) and a fresh planner of its ranks, every rank's layout
        checked first (a bad rule fails before an answer starts) and none kept: for one pass over the
        ranks (`plan_ranks_once`, the JSON plan) in memory that does not grow with the world size."""
        planner, plan = make_planner(src.ckpt, src.manifest, layout)
        for rank in range(plan.world):  # the collector paused rank by rank: a rank's layouts leave cycles behind
            with paused_gc():
                planner.layouts(rank)
            planner.forget(rank)
        return plan, planner

    def rank_plan(self, src: ServedCheckpoint, layout: Layout | int, rank: int) -> tuple[str, RankPlan]:
        """(plan digest, RankPlan) for one rank, cached by stat identity, manifest, layout and rank; the
        tensor groups of a (checkpoint, manifest, layout) are kept too, so its other ranks plan fast."""
        key = (src.name, src.key, src.manifest.digest(), as_layout(layout))
        hit = self._plans.get((*key, rank))
        if hit is None:
            planned = self._planners.get(key)
            if planned is None:
                planner, plan = make_planner(src.ckpt, src.manifest, layout)
                planned = (plan.digest, planner)
                self._planners.put(key, planned)
            with paused_gc():
                hit = (planned[0], planned[1].plan(rank))
            self._plans.put((*key, rank), hit)
        return hit

    def store_rules(self, name: str, manifest: Manifest, *, label: str = DEFAULT_LABEL,
                    tps: Sequence[int] = ()) -> dict[str, Any]:
        """Validate `manifest` against checkpoint `name` (and each of `tps`), store it under `label`."""
        entry, _ = self._entry(name)
        _, warnings = resolve_rules(list(entry.ckpt.tensors), manifest, strict=False)
        for tp in (1, *tps):  # every rule's kind and options must apply to the tensors it matches
            make_plan(entry.ckpt, manifest, tp)
        path = self._stored_path(name, label)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, manifest.to_dict())
        return {"name": name, "label": label, "digest": manifest.digest(), "warnings": warnings,
                "manifest": manifest.to_dict()}


def _file_of(t: Any) -> str:
    """The file holding tensor `t`: its own (a checkpoint's), or its first piece's (a rank-file directory's)."""
    return t.file.name if hasattr(t, "file") else t.pieces[0].info.file.name


def plan_ranks_once(planner: LayoutPlanner, ranks: Iterable[int]) -> Iterator[RankPlan]:
    """`planner.plan(r)` for each of `ranks`, each rank's layouts dropped once it is planned."""
    for rank in ranks:
        with paused_gc():
            rp = planner.plan(rank)
        planner.forget(rank)
        yield rp


def allowed_upload(filename: str) -> str:
    """Upload targets: `*.safetensors` (a plain name), config.json or the index file."""
    if filename in (CONFIG_NAME, INDEX_NAME):
        return filename
    if filename.endswith(".safetensors") and valid_name(filename):
        return filename
    raise BadRequest(
        f"file name {filename!r} is not accepted: upload NAME.safetensors (letters, digits, '.', '_', '-'), "
        f"{CONFIG_NAME} or {INDEX_NAME}"
    )
