"""`reshard.io.rank_stream` with a sink's copies of its pieces: `runs` sends a copied piece as a range
of its copy (`PieceCopies`), the same bytes, and by default (`NO_COPIES`) gathers it; the stream
imports nothing of the service."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import reshard.io.rank_stream as rank_stream
from reshard.io.rank_stream import RankStream
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan

pytestmark = pytest.mark.pure


class Copies:
    """Whole copies of pieces in one file: piece number -> (fd, offset)."""

    def __init__(self, fd: int, at: dict[int, int]) -> None:
        self.at = {i: (fd, offset) for i, offset in at.items()}

    def copy_of(self, piece: int) -> tuple[int, int] | None:
        return self.at.get(piece)


def _body(stream: RankStream, runs: list[tuple[int, int, object]]) -> bytes:
    out = bytearray()
    for pos, n, src in runs:
        if src is None:
            buf = memoryview(bytearray(n))
            stream.read_into(pos, buf)
            out += buf
        else:
            fd, offset = src  # type: ignore[misc]
            out += os.pread(fd, n, offset)
    return bytes(out)


def test_copied_pieces_go_out_as_ranges_of_their_copy(local_root: Path, tmp_path: Path) -> None:
    src, manifest = open_source(local_root / "llama")
    rp = make_plan(src, manifest, 2).ranks[0]
    with RankStream(rp) as stream:
        whole = b"".join(bytes(c) for c in stream.chunks())
        gathered = stream.gathered(1024)
        assert len(gathered) >= 2  # the row-split weights
        copy = tmp_path / "copy.bin"
        at, lead = {}, 100
        with copy.open("wb") as f:
            f.write(bytes(lead))
            for i, start, n in gathered:
                at[i] = f.tell()
                f.write(whole[start : start + n])
        fd = os.open(copy, os.O_RDONLY)
        try:
            for direct_min in (1024, rp.size + 1):
                plain = list(stream.runs(chunk_size=1 << 16, direct_min=direct_min))
                copied = list(stream.runs(chunk_size=1 << 16, direct_min=direct_min, copies=Copies(fd, at)))
                assert _body(stream, plain) == _body(stream, copied) == whole
                sent = [(pos, n, s) for pos, n, s in copied if s is not None and s[0] == fd]
                if direct_min > rp.size:  # nothing long enough for the kernel: every byte read
                    assert sent == [] and copied == plain
                    continue
                assert [(pos, n) for pos, n, _ in sent] == [(start, n) for _, start, n in gathered]
                assert [s[1] for _, _, s in sent] == [at[i] for i, _, _ in gathered]
                assert not any(s is not None and s[0] == fd for _, _, s in plain)
        finally:
            os.close(fd)


def test_the_stream_imports_nothing_of_the_service() -> None:
    tree = ast.parse(Path(rank_stream.__file__).read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names and not any(m.startswith("reshard.service") for m in names)
    assert "reshard.service" not in Path(rank_stream.__file__).read_text()
