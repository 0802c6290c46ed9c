"""Fill materialized parameters from a rank file's byte stream, as the bytes arrive.

The stream is the rank file itself (from disk or from the service): header first, then each tensor's
bytes in offset order. Bytes go straight into the parameter's storage when dtype and device allow;
otherwise through one tensor-sized buffer. No second copy of the shard ever exists.

A body that reads into the caller's memory (`reshard.io.client.body`: a rank file, or the service's answer)
is read into each parameter's own storage (`preadv`/`recv_into`: the kernel's one copy), and the
sha256 follows in a thread, over the bytes already in place (one pass; the reader never waits for it).
Chunk iterables (any other source) are copied in as they come.

A local rank file (`mapped=True`) is not read at all where it need not be: parameters that hold its
bytes as they are become views of a leased private mapping of it (`reshard.fill.mapped_params`). Its sha256
(`verify="auto"`) is trusted while the file is unchanged since it was last verified or written
(`reshard.io.verified`), else hashed (from the mapping, in a thread, while the rest is read);
`verify="always"` hashes it every time. A service's answer is always hashed as it arrives.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from reshard.errors import CheckpointError, HeaderError, IntegrityError, PlanError, ReshardError
from reshard.fill.mapped_params import RankMap, bindable, map_rank_file
from reshard.format.checkpoint import MAX_HEADER_BYTES, parse_header
from reshard.format.rank_file import RankPlace, decode_metadata
from reshard.format.torch_side import TORCH_DTYPES
from reshard.io import verified
from reshard.io.client.body import FileBody, RankBytes
from reshard.io.hashing import BackgroundHash
from reshard.layout.mesh import Layout
from reshard.layout.placement import describe_layout
from reshard.rules.quant.dequant import Dequantizer


class RankHeader:
    """A parsed rank-file header: tensor entries plus the shard's self-description."""

    def __init__(self, raw: bytes, source: str) -> None:
        self.raw, self.source = raw, source
        self.total = len(raw) + _data_end(raw)  # the stream's length, as the header says where the data ends
        self.entries, self.metadata = parse_header(raw, path=source, file_size=self.total)
        try:
            meta = decode_metadata(self.metadata, source)
            self.layout = describe_layout(meta, source)
        except (CheckpointError, PlanError) as e:
            raise HeaderError(str(e)) from None
        self.tp, self.rank = meta.tp, meta.rank
        self.place = RankPlace(meta.tp, meta.rank, meta.layout, meta.coords, meta.plan)  # as a file of the same rank records it
        self.tensors: dict[str, dict[str, Any]] = meta.tensors

    def check(self, rank: int, layout: Layout, *, fix: str) -> None:
        """`CheckpointError` unless this is the shard of `rank` of `layout`."""
        if (self.rank, self.layout) != (rank, layout):
            raise CheckpointError(f"{self.source}: is the shard of rank {self.rank} of {self.layout.describe()}, but this "
                                  f"process is rank {rank} of {layout.describe()}; {fix}")


    def dtypes(self) -> dict[str, torch.dtype]:
        return {k: TORCH_DTYPES[e["dtype"]] for k, e in self.entries.items()}

    def model_tensors(self) -> dict[str, dict[str, Any]]:
        """The self-description of the tensors that become model tensors: all but FP8 scales, which
        the fill consumes while dequantizing their weights."""
        companions = Dequantizer(self.tensors, self.dtypes()).companions
        return {n: d for n, d in self.tensors.items() if n not in companions}


def _data_end(raw: bytes) -> int:
    try:
        obj = json.loads(raw[8:])
        return max((v["data_offsets"][1] for k, v in obj.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return 0  # parse_header will say what is wrong


def read_header_from(chunks: Iterator[memoryview | bytes] | RankBytes, source: str) -> tuple[RankHeader, bytearray]:
    """Take bytes from `chunks` until the header is complete; return it and the bytes after it (none
    from a body that reads into memory: the rest stays in it)."""
    if hasattr(chunks, "readinto"):
        return _read_header(chunks, source), bytearray()
    buf = bytearray()
    need = 8
    while len(buf) < need:
        try:
            buf += next(chunks)
        except StopIteration:
            raise HeaderError(f"{source}: stream ended after {len(buf)} bytes, inside the header") from None
        if need == 8 and len(buf) >= 8:
            (n,) = struct.unpack("<Q", buf[:8])
            if n > MAX_HEADER_BYTES:
                raise HeaderError(f"{source}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            need = 8 + n
    return RankHeader(bytes(buf[:need]), source), buf[need:]


def read_raw_header(body: RankBytes, source: str) -> bytes:
    """The first bytes of `body` up to the end of its safetensors header (the 8-byte length, then the JSON)."""
    head = bytearray(8)
    body.readinto(memoryview(head))
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"{source}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    head += bytes(n)
    body.readinto(memoryview(head)[8:])
    return bytes(head)


def _read_header(body: RankBytes, source: str) -> RankHeader:
    header = RankHeader(read_raw_header(body, source), source)
    if header.total != body.size:
        raise IntegrityError(f"{source}: {body.size} bytes, but its header describes {header.total}: the rank file "
                             "is truncated or corrupt, and nothing was read from it; write or pull it again")
    return header


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a (contiguous, CPU, non-empty) tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


VERIFY = ("auto", "always")


@dataclass(frozen=True)
class Filled:
    """How a fill went: bytes bound to the file's mapping rather than copied, and how the bytes were
    verified: "sha256" (hashed), "identity" (a local file unchanged since it was verified), "none"."""

    mapped: int = 0
    verified: str = "none"


def fill_parameters(
    header: RankHeader, rest: Iterable[memoryview | bytes], targets: dict[str, torch.Tensor], *,
    sha256: str | None = None, leftover: bytes | bytearray = b"", keep: bool = False, mapped: bool = False,
    verify: str = "auto",
) -> Filled:
    """Copy every tensor of the stream into `targets[name]` (materialized, same shape; a view into a
    larger tensor is fine, and a dtype other than the shard's is cast). On a failure the error says
    how many tensors had been filled.

    `leftover` is what came after the header in its chunk; `rest` yields the remaining bytes.
    With `sha256`, the whole stream (header included) must hash to it. FP8 weights are dequantized
    into their parameters' dtype (`reshard.rules.quant.dequant`); with `keep` they are an error instead.
    `mapped` binds what it can to a local file's mapping, `verify` says when its sha256 is trusted
    (see the module docstring).
    """
    if verify not in VERIFY:
        raise ValueError(f"verify={verify!r}: expected one of {VERIFY}")
    order = sorted(header.entries.items(), key=lambda kv: kv[1]["data_offsets"][0])
    quant = Dequantizer(header.tensors, header.dtypes())
    missing = sorted(set(targets) - set(header.entries))
    extra = sorted(set(header.entries) - set(targets) - quant.companions)
    if missing or extra:
        raise PlanError(f"{header.source}: shard and model disagree: the shard lacks {missing[:3]}, "
                        f"the model lacks {extra[:3]}")
    plans = []
    for name, e in order:
        src_dtype = TORCH_DTYPES[e["dtype"]]
        t = targets[name] if name in targets else torch.empty(e["shape"], dtype=src_dtype, device="meta")  # a scale
        if tuple(t.shape) != tuple(e["shape"]):
            raise PlanError(f"{header.source}: {name} has shape {e['shape']} in the shard, {list(t.shape)} in the model")
        quant.check_target(name, t, keep=keep)
        direct = t.device.type == "cpu" and t.dtype == src_dtype and t.is_contiguous()
        plans.append((name, t, src_dtype, direct))

    done: list[str] = []  # names fully written; `partial` the one whose bytes began to land
    partial: list[str] = []
    try:
        if hasattr(rest, "readinto"):
            filled = _read_in(header, plans, rest, quant, targets, done, partial, sha256=sha256, mapped=mapped,
                              verify=verify)
        else:
            sha = hashlib.sha256(header.raw) if sha256 else None
            _copy(header, plans, _chunks(leftover, rest), sha, quant, targets, done, partial)
            _verify(header, sha.hexdigest() if sha is not None else None, sha256)
            filled = Filled(verified="sha256" if sha256 else "none")
    except ReshardError as e:  # a truncated or corrupt stream, or a failed download: say what was written
        half = f" and {partial[0]} in part" if partial and partial[0] not in done else ""
        raise type(e)(f"{e}; {len(done)} of {len(plans)} tensors had been filled{half}, so the parameters hold an "
                      "incomplete or unverified shard: fill them again before use") from None
    header.tensors = quant.dequantized()  # what the model now holds, for `save_rank_shard`
    return filled


def _verify(header: RankHeader, got: str | None, want: str | None) -> None:
    if got is not None and want is not None and got != want:
        raise IntegrityError(f"{header.source}: sha256 {got} does not match the recorded {want}")


PIECE = 16 << 20  # bytes read into a parameter before they are handed to the hash


def _read_in(header: RankHeader, plans: list[tuple[str, torch.Tensor, torch.dtype, bool]], body: RankBytes,
             quant: Dequantizer, targets: dict[str, torch.Tensor], done: list[str], partial: list[str], *,
             sha256: str | None, mapped: bool, verify: str) -> Filled:
    """Bind what can be bound to a local file's mapping; read the rest by `body` straight into each
    target (or its staging tensor, where a cast or a dequantization follows); verify as the module says."""
    local = isinstance(body, FileBody)
    want = sha256 or (body.expected_sha256() if local else None)
    check = sha256 is not None or body.verify
    m = map_rank_file(body.fd, body.size, body.name) if mapped and local else None
    trusted = check and verify == "auto" and local and want is not None and verified.trusted(body.fd, want)
    try:
        bound = _bind(m, header, plans) if m is not None else set()
        from_map = check and not trusted and m is not None
        with BackgroundHash(hashlib.sha256() if from_map else None, backlog=None) as whole:
            for piece in m.pieces() if from_map else ():  # type: ignore[union-attr]
                whole.update(piece)  # hashed in a thread while the rest is read
            streamed = _read_tensors(header, plans, body, quant, targets, done, partial, bound,
                                     hash_it=check and not trusted and m is None)
            got = whole.hexdigest() if from_map else streamed
    finally:
        if m is not None:
            m.done()
    if check and not trusted:
        want = want or body.expected_sha256()
        _verify(header, got, want)
        if local and want is not None:
            verified.record(body.fd, want, path=body.name)
    how = "identity" if trusted else "sha256" if check else getattr(body, "verified_as", None) or "none"
    return Filled(m.bytes if m is not None else 0, how)


def _bind(m: RankMap, header: RankHeader, plans: list[tuple[str, torch.Tensor, torch.dtype, bool]]) -> set[str]:
    """The names of the tensors made views of the mapping (every one `bindable`)."""
    base, bound = len(header.raw), set()
    for name, t, src_dtype, direct in plans:
        offset = base + header.entries[name]["data_offsets"][0]
        if direct and bindable(t, src_dtype, offset):
            m.bind(t, offset)
            bound.add(name)
    return bound


def _read_tensors(header: RankHeader, plans: list[tuple[str, torch.Tensor, torch.dtype, bool]], body: RankBytes,
                  quant: Dequantizer, targets: dict[str, torch.Tensor], done: list[str], partial: list[str],
                  bound: set[str], *, hash_it: bool) -> str | None:
    """Read every tensor not in `bound`, in file order; the sha256 of the whole stream when `hash_it`."""
    with BackgroundHash(hashlib.sha256() if hash_it else None, backlog=None) as hasher:
        hasher.update(header.raw)
        for name, t, src_dtype, direct in plans:
            if name in bound:
                done.append(name)
                continue
            if bound:
                body.seek(len(header.raw) + header.entries[name]["data_offsets"][0])  # type: ignore[attr-defined]
            staging = t if direct else torch.empty(t.shape, dtype=src_dtype)
            dst = byte_view(staging) if staging.numel() else memoryview(bytearray())
            if direct:
                partial[:] = [name]
            for at in range(0, len(dst), PIECE):
                piece = dst[at : at + PIECE]
                body.readinto(piece)
                hasher.update(piece)
            if not direct:
                hasher.wait()  # hashed before the staging tensor is released
                for target, value in quant.feed(name, staging):
                    into(targets[target], value, name=target)
            done.append(name)
        return hasher.hexdigest() if hash_it else None


def _copy(header: RankHeader, plans: list[tuple[str, torch.Tensor, torch.dtype, bool]], it: Iterator[memoryview],
          sha: Any, quant: Dequantizer, targets: dict[str, torch.Tensor], done: list[str], partial: list[str]) -> None:
    pending = memoryview(b"")
    for name, t, src_dtype, direct in plans:
        staging = t if direct else torch.empty(t.shape, dtype=src_dtype)
        if direct:
            partial[:] = [name]
        pending = _take(staging, pending, it, sha, f"{header.source}: stream ended inside tensor {name}")
        if not direct:
            for target, value in quant.feed(name, staging):  # an FP8 weight: dequantized
                into(targets[target], value, name=target)
        done.append(name)
    # exhaust the stream (an HTTP client verifies its digest at the end); nothing may follow
    if len(pending) or any(len(c) for c in it):
        raise IntegrityError(f"{header.source}: bytes after the last tensor")


def iter_tensors(header: RankHeader, rest: Iterable[memoryview | bytes], *, sha256: str | None = None,
                 leftover: bytes | bytearray = b"", only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the stream, in file order, as a CPU tensor of its own (one tensor's bytes in memory
    at a time), for an engine that takes `(name, tensor)` pairs; the stream must end after the last
    tensor and hash (header included) to `sha256`, or, without it, to the digest the body itself expects
    (`RankBytes.expected_sha256`: the service's, for its answer), checked before the last pair is handed
    out. With `only`, the other tensors are read past (hashed, never allocated) and not handed out."""
    order = sorted(header.entries.items(), key=lambda kv: kv[1]["data_offsets"][0])
    from_body = sha256 is None and bool(getattr(rest, "verify", False)) and hasattr(rest, "expected_sha256")
    sha = hashlib.sha256(header.raw) if sha256 or from_body else None
    chunks = _chunks(leftover, rest)
    pending, last = memoryview(b""), None
    for name, e in order:
        ended = f"{header.source}: stream ended inside tensor {name}"
        if only is not None and name not in only:
            pending = _consume(e["data_offsets"][1] - e["data_offsets"][0], pending, chunks, sha, ended)
            continue
        t = torch.empty(e["shape"], dtype=TORCH_DTYPES[e["dtype"]])
        pending = _take(t, pending, chunks, sha, ended)
        if last is not None:
            yield last
        last = (name, t)
    if len(pending) or any(len(c) for c in chunks):
        raise IntegrityError(f"{header.source}: bytes after the last tensor")
    want = sha256 or (rest.expected_sha256() if from_body else None)  # type: ignore[attr-defined]
    if sha is not None and sha.hexdigest() != want:
        raise IntegrityError(f"{header.source}: sha256 {sha.hexdigest()} does not match the recorded {want}")
    if last is not None:
        yield last


def _chunks(leftover: bytes | bytearray, rest: Iterable[memoryview | bytes]) -> Iterator[memoryview]:
    if leftover:
        yield memoryview(leftover)
    for c in rest:
        yield memoryview(c)


def _take(t: torch.Tensor, pending: memoryview, it: Iterator[memoryview], sha: Any, ended: str) -> memoryview:
    """Fill `t`'s bytes from `pending`, then from `it` (hashing what it takes when `sha`); what is left over."""
    dst = byte_view(t) if t.numel() else memoryview(bytearray())
    return _consume(len(dst), pending, it, sha, ended, dst)


def _consume(n: int, pending: memoryview, it: Iterator[memoryview], sha: Any, ended: str,
             dst: memoryview | None = None) -> memoryview:
    """Take `n` bytes from `pending`, then from `it` (hashing what it takes when `sha`), into `dst` if given
    (else read past them); what is left over."""
    got = 0
    while got < n:
        if not pending:
            pending = next(it, None)  # type: ignore[arg-type]
            if pending is None:
                raise IntegrityError(ended)
            if sha is not None:
                sha.update(pending)
        k = min(len(pending), n - got)
        if dst is not None:
            dst[got : got + k] = pending[:k]
        pending, got = pending[k:], got + k
    return pending


def into(target: torch.Tensor, staged: torch.Tensor, *, name: str) -> None:
    """The one place where a shard tensor's bytes (`staged`, as stored) become the target's value:
    dtype cast and device copy. A dequantizing kind hooks in here."""
    with torch.no_grad():
        target.copy_(staged)
