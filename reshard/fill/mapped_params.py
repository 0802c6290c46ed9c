"""Parameters bound to a private mapping of their rank file: `fill_model` from a local file without a copy.

A tensor whose bytes the parameter holds exactly as the file does (same dtype, on the CPU, contiguous,
a parameter or DTensor local tensor that is a whole storage of its own, at an offset in the file that
is a multiple of its element size) is not read at all: the parameter's storage becomes a view of a
`MAP_PRIVATE` mapping of the file, one storage per tensor (`torch.frombuffer` at its offset, as
safetensors' own mappings are), and its old storage (never touched since `to_empty`) is freed. The
others (dtype casts, FP8 dequantization, views into fused MoE expert parameters) are read into their
own memory as before (`reshard.fill.into_params`).

What a mapping means:

- Memory: the pages are the page cache's, mapped as the model first touches them (RssFile, not
  RssAnon), shared by every process that maps the file. A private mapping copies a page into memory
  of the process's own the first time it is written (copy-on-write): an optimizer's first step copies
  the parameters it updates, which costs what a copying fill costs, spread over that step; a model
  that is only run never copies. Parameters set to new tensors later (`load_state_dict` copies in
  place, `model.to(...)` makes new ones) behave as for any tensor.
- A file changed underneath: a mapped page that a truncation removes kills the process with SIGBUS
  when touched, and a page not yet copied shows what the file holds now. So a file is mapped only
  while this process holds a read lease on it (`F_SETLEASE`, as the server's mappings do,
  `reshard.io.source.mapped_files`): whoever opens it for writing or truncates it is held by the kernel (at most
  /proc/sys/fs/lease-break-time, 45 s by default) while this process gets SIGIO. The handler runs in
  the main thread between two Python bytecodes (never inside one of the main thread's tensor ops),
  copies every tensor still bound to the mapping into memory of its own, and gives the lease back; the
  writer goes on, and the model keeps the values it had. `reshard write` and the trainer's `--save`
  replace rank files by a rename, which neither breaks the lease nor changes the mapped file.
- Where no lease can be had (another user's file and no CAP_LEASE, a file open for writing somewhere,
  a file system without leases) or the handler cannot be installed (a fill outside the main thread,
  before any fill in it), the bytes are copied, as before.

Limits: a thread other than the main one writing a bound parameter while the handler copies it; a
view of a parameter taken before the lease broke (it keeps the old pages); a main thread blocked in
one C call (a collective) for longer than the lease-break time.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from reshard.io.source.mapped_files import file_key, leased_copy

_LIVE: set[RankMap] = set()  # mappings that still have bound tensors or are being filled
_HANDLER = {"installed": False}


class RankMap:
    """A private mapping of one rank file, leased for as long as any tensor is bound to it."""

    def __init__(self, fd: int, size: int, name: str) -> None:
        self.fd, self.size, self.name = fd, size, name
        self.mm: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bound: list[tuple[weakref.ref[torch.Tensor], int]] = []  # (tensor, the address it was bound at)
        self.bytes = 0
        weakref.finalize(self.mm, _closed, self, fd)  # the last view gone: the lease and the descriptor too
        _LIVE.add(self)

    def bind(self, target: torch.Tensor, offset: int) -> None:
        """Make `target`'s storage the file's bytes at `offset` (checked by `bindable`)."""
        assert self.mm is not None
        view = torch.frombuffer(self.mm, dtype=target.dtype, count=target.numel(), offset=offset).view(target.shape)
        with torch.no_grad():
            target.set_(view)
        self.bound.append((weakref.ref(target), target.data_ptr()))
        self.bytes += target.numel() * target.element_size()

    def pieces(self, block: int = 16 << 20) -> Iterator[memoryview]:
        """The file's bytes as mapped, `block` at a time (to hash them)."""
        assert self.mm is not None
        whole = memoryview(self.mm)
        for at in range(0, self.size, block):
            yield whole[at : at + block]

    def done(self) -> None:
        """The fill is over: the mapping lives on only through the tensors bound to it."""
        self.mm = None

    def broken(self) -> bool:
        try:
            return fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True

    def detach(self) -> None:
        """Copy every tensor still bound into memory of its own, then give the lease back."""
        with torch.no_grad():
            for ref, ptr in self.bound:
                t = ref()
                if t is not None and t.data_ptr() == ptr:
                    t.set_(t.clone())
        self.bound.clear()
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        _LIVE.discard(self)


def _closed(m: RankMap, fd: int) -> None:
    _LIVE.discard(m)
    with contextlib.suppress(OSError):
        os.close(fd)  # gives the lease back


def bindable(t: torch.Tensor, dtype: torch.dtype, offset: int) -> bool:
    """Whether `t` can become a view of the file's bytes at `offset` (see the module docstring)."""
    return (t.device.type == "cpu" and t.dtype == dtype and t.numel() > 0 and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and offset % t.element_size() == 0)


def map_rank_file(fd: int, size: int, name: str) -> RankMap | None:
    """A leased private mapping of the file open on `fd` (its own descriptor, so that the lease lives
    as long as the mapping), or None where one cannot be had (see the module docstring)."""
    key = file_key(fd)
    if not _install_handler() or key[2] != size:
        return None
    own = leased_copy(fd, key)
    if own is None:
        return None
    try:
        return RankMap(own, size, name)
    except (OSError, ValueError):
        os.close(own)
        return None


def _install_handler() -> bool:
    """The SIGIO handler that detaches broken mappings (once per process, from the main thread)."""
    if _HANDLER["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGIO)

    def on_sigio(sig: int, frame: Any) -> None:
        for m in [m for m in list(_LIVE) if m.broken()]:
            m.detach()
        if callable(previous):
            previous(sig, frame)

    signal.signal(signal.SIGIO, on_sigio)
    _HANDLER["installed"] = True
    return True


def bound_bytes() -> int:
    """Bytes of tensors bound to leased mappings now, in this process."""
    return sum(m.bytes for m in _LIVE if m.bound)


__all__ = ["RankMap", "bindable", "bound_bytes", "map_rank_file"]
