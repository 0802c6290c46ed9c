"""Where each chunk of a `dcp.save` checkpoint starts in its `.distcp` file, found with few small reads.

A chunk saved with torch's default serialization is a `torch.save` archive (`reshard.format.torch_item`):
its raw bytes sit after a pickle and a few zip records, located through the archive's central
directory at its end. Archives of tensors of one dtype and shape have the same first bytes up to the
tensor's (the pickle, the records before it: no dates, no checksums), so one of them is located in
full and the others are matched against its first bytes: each item costs its first kilobyte, read in
one go with its neighbours' (runs of small items, norms and biases, in one read), and a remote file (S3,
GCS, HTTP) has those reads made by a few threads at once. A `.distcp` file written with
`serialization_format=SAFETENSORS` is an ordinary safetensors file placed by `DCP_SHARDING_INFO`; its
chunks are found from its header instead.

`chunk_starts(d, files, items, tensors)` gives the absolute byte offset of each item's tensor.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.checkpoint import Directory, FileInfo, LocalDirectory
from reshard.format.dcp_metadata import DcpItem, DcpTensor
from reshard.format.dcp_sharding import sharding_info
from reshard.format.torch_item import HEAD, locate_tensor
from reshard.io.pread import pread_full

__all__ = ["chunk_starts"]

MERGE_GAP = 64 << 10  # ranges closer than this are read as one
_ZIP_MAGIC = b"PK\x03\x04"
_THREADS = 16

Key = tuple[str, tuple[int, ...]]


def chunk_starts(d: Directory, files: dict[str, FileInfo], items: Iterable[DcpItem],
                 tensors: dict[str, DcpTensor]) -> dict[Key, int]:
    """(fqn, offsets) -> the absolute byte offset, in its file, of each item's row-major tensor bytes."""
    by_file: dict[str, list[DcpItem]] = {}
    for item in items:
        info = files[item.file]
        if item.offset + item.length > info.size:
            raise CheckpointError(f"{info.path}: item {item.fqn!r} at {item.offset} (+{item.length} bytes) is past "
                                  f"the file's end ({info.size} bytes); the checkpoint is incomplete")
        by_file.setdefault(item.file, []).append(item)
    out: dict[Key, int] = {}
    templates: dict[tuple[str, tuple[int, ...], int], tuple[bytes, int]] = {}  # (dtype, shape, length) -> (head, start)
    with _Fetcher(d, files) as fetch:
        windows = fetch.many({name: _ranges(its) for name, its in by_file.items()})
        for name, its in by_file.items():
            info, win = files[name], windows[name]
            if win.read(0, 4) != _ZIP_MAGIC:
                out.update(_safetensors_starts(d, name, its))
                continue
            for it in its:
                t = tensors[it.fqn]
                shape = next(c.sizes for c in t.chunks if c.offsets == it.offsets)
                known = templates.get((t.dtype, shape, it.length))
                if known is not None and win.read(it.offset, it.offset + len(known[0])) == known[0]:
                    out[(it.fqn, it.offsets)] = it.offset + known[1]
                    continue
                where = f"{info.path} (item {it.fqn!r} at offsets {list(it.offsets)}, bytes {it.offset}+{it.length})"
                rel = locate_tensor(lambda a, b, o=it.offset, w=win: w.read(o + a, o + b), it.length, where=where,
                                    dtype=t.dtype, shape=shape)
                templates.setdefault((t.dtype, shape, it.length), (win.read(it.offset, it.offset + rel), rel))
                out[(it.fqn, it.offsets)] = it.offset + rel
    return out


def _ranges(items: list[DcpItem]) -> list[tuple[int, int]]:
    """Each item's head (its tail is read when it is located in full), runs closer than `MERGE_GAP`
    merged, byte 0 first (the file's kind)."""
    spans = [(0, 4)] + [(it.offset, it.offset + min(it.length, HEAD)) for it in items]
    spans.sort()
    merged = [list(spans[0])]
    for a, b in spans[1:]:
        if a - merged[-1][1] <= MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _safetensors_starts(d: Directory, name: str, items: list[DcpItem]) -> dict[Key, int]:
    info, local = d.header(name)
    offsets = sharding_info(info.metadata, {n: t.shape for n, t in local.items()}, where=str(info.path))
    if offsets is None:
        raise CheckpointError(f"{info.path}: neither torch.save items nor a safetensors file with DCP_SHARDING_INFO")
    where = {(n, offsets[n]): t.start for n, t in local.items()}
    missing = [it for it in items if (it.fqn, it.offsets) not in where]
    if missing:
        raise CheckpointError(f"{info.path}: .metadata places {missing[0].fqn!r} at offsets {list(missing[0].offsets)} "
                              "in this file, but its DCP_SHARDING_INFO does not")
    return {(it.fqn, it.offsets): where[(it.fqn, it.offsets)] for it in items}


class _Window:
    """Bytes of one file fetched ahead in ranges; `read(a, b)` from them, else one more read."""

    def __init__(self, fetched: list[tuple[int, bytes]], fetch: Callable[[int, int], bytes]) -> None:
        self.starts = [a for a, _ in fetched]
        self.blobs = [b for _, b in fetched]
        self.fetch = fetch

    def read(self, a: int, b: int) -> bytes:
        i = bisect.bisect_right(self.starts, a) - 1
        if i >= 0 and b <= self.starts[i] + len(self.blobs[i]):
            lo = a - self.starts[i]
            return self.blobs[i][lo : lo + b - a]
        return self.fetch(a, b)


class _Fetcher:
    """Ranged reads of a checkpoint's files: `pread` locally, ranged GETs (several threads) from a store."""

    def __init__(self, d: Directory, files: dict[str, FileInfo]) -> None:
        self.d, self.files = d, files
        self.local = isinstance(d, LocalDirectory)
        self.fds: dict[str, int] = {}

    def __enter__(self) -> _Fetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def one(self, name: str, a: int, b: int) -> bytes:
        if not self.local:
            data, _ = self.d.store.get(self.d.key(name), a, b, version=self.files[name].version)  # type: ignore[attr-defined]
            return bytes(data)
        fd = self.fds.get(name)
        if fd is None:
            try:
                fd = self.fds[name] = os.open(self.d.path(name), os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{self.d.path(name)}: cannot read: {e.strerror}") from None
        buf = bytearray(b - a)
        n = pread_full(fd, memoryview(buf), a)
        return bytes(buf[:n])

    def many(self, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, _Window]:
        jobs = [(name, a, b) for name, rs in ranges.items() for a, b in rs]
        if self.local:
            got = [self.one(*job) for job in jobs]
        else:
            with ThreadPoolExecutor(min(_THREADS, max(1, len(jobs)))) as pool:
                got = list(pool.map(lambda job: self.one(*job), jobs))
        fetched: dict[str, list[tuple[int, bytes]]] = {name: [] for name in ranges}
        for (name, a, _), data in zip(jobs, got):
            fetched[name].append((a, data))
        return {name: _Window(f, lambda a, b, n=name: self.one(n, a, b)) for name, f in fetched.items()}
