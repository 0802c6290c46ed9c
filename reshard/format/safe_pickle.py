"""Reading the pickles torch writes without running them: an unpickler that admits a fixed list of names.

`pickle.load` calls whatever a pickle names (`os.system`, `builtins.open`, ...), so a crafted file runs
code when it is read. `restricted_loads(data, allowed, where=...)` resolves every global the pickle
names through `allowed` (`(module, name) -> a stand-in`: a plain value, a container constructor or one
of the small record classes below) and refuses anything else before it is called: one
`CheckpointError` naming the file and the global, and nothing of the pickle runs. The stand-ins hold
values only (`Record`: attributes from the pickle's state), so no class of torch is imported or built.
The DCP metadata (`reshard.format.dcp_metadata`) and the tensor items of `torch.save`
(`reshard.format.torch_item`) are read this way.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from reshard.errors import CheckpointError

__all__ = ["Record", "restricted_loads"]


class Record:
    """An object of a pickled class, as plain attributes: the constructor's arguments (`args`) and the
    state the pickle set (a dict becomes attributes; anything else is kept as `state`)."""

    kind = "Record"
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any, **fields: Any) -> None:
        """A pickle's call `Cls(*args)`; `fields` (set as attributes) are for reshard's own stand-ins."""
        self.__dict__.update(fields, args=args)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) \
                and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **state[1]}  # (dict state, slot state)
        if isinstance(state, dict) and all(isinstance(k, str) for k in state):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.__dict__.items() if k not in ("args", "state") or v}
        return f"{self.kind}({shown})"


def record_class(name: str) -> type[Record]:
    """A `Record` subclass named `name` (what `isinstance` checks after loading)."""
    return type(name, (Record,), {"kind": name})


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], where: str,
                 persistent: Callable[[Any], Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed, self.where, self.persistent = allowed, where, persistent

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        if self.persistent is None:
            raise _Refused(f"a persistent id {str(pid)[:80]!r}")
        return self.persistent(pid)


class _Refused(Exception):
    pass


def restricted_loads(data: bytes, allowed: Mapping[tuple[str, str], Any], *, where: str, what: str,
                     persistent: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` (the contents of `where`, a `what`) admitting only the globals in `allowed`;
    `persistent` resolves persistent ids (torch's storages), none admitted without it."""
    try:
        return _Unpickler(data, allowed, where, persistent).load()
    except _Refused as e:
        raise CheckpointError(
            f"{where}: refused: this {what} asks for {e}, which a {what} never holds; it was not run "
            "(reading this file with torch or pickle.load would run it: do not, unless you trust its source)") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (a malformed pickle: any error of the unpickler or a stand-in)
        raise CheckpointError(f"{where}: not a readable {what}: {type(e).__name__}: {str(e)[:200]}") from None
