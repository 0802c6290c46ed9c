"""The plan is exact (sizes, header, offsets), the stream is seekable, writes are deterministic and atomic."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.cli import Interrupted, stop_on_signals
from reshard.errors import SourceChangedError
from reshard.format.checkpoint import Checkpoint
from reshard.format.rank_file import rank_file_name
from reshard.io.outfs import TMP_PREFIX
from reshard.io.rank_stream import RankStream
from reshard.io.sinks import outfile
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.types import plan_to_json
from reshard.rules.manifest import Manifest
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.core import assert_same, run_cli, sha256_file

REPO = Path(__file__).resolve().parents[2]
SIZES = {"vocab_size": 250, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "ckpt"
    return make_checkpoint(root, llama_config(**SIZES), dtype=torch.bfloat16, num_files=3, seed=11)


@pytest.fixture(scope="module")
def strided_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """Row splits with short runs (gathered), long runs (read directly), padding and several dtypes."""
    gen = torch.Generator().manual_seed(12)
    tensors = {
        "narrow.weight": torch.randn(512, 64, generator=gen),  # 128-byte runs at tp=2
        "wide.weight": torch.randn(4, 131072, generator=gen),  # 256 KiB runs at tp=2
        "pad.weight": torch.randn(33, 7, generator=gen).to(torch.float16),  # row, padded
        "packed.weight": torch.randint(0, 100, (40, 3), generator=gen),  # packed 8|32
        "norm.weight": torch.randn(64, generator=gen).to(torch.bfloat16),
    }
    root = tmp_path_factory.mktemp("strided")
    save_file(tensors, str(root / "model.safetensors"))
    manifest = Manifest.from_dict({"rules": [
        {"pattern": "narrow.weight", "kind": "row"},
        {"pattern": "wide.weight", "kind": "row"},
        {"pattern": "pad.weight", "kind": "row", "pad": True},
        {"pattern": "packed.weight", "kind": "packed_column", "blocks": [8, 32]},
    ]})
    return root, manifest


@pytest.mark.pure
def test_plan_sizes_header_and_offsets_match_written_files(hf_ckpt: Path, tmp_path: Path) -> None:
    ckpt, manifest = open_source(hf_ckpt)
    plan = make_plan(ckpt, manifest, 4)
    write_shards(ckpt, plan, tmp_path, progress=False)
    doc = plan_to_json(plan)
    for rp, entry in zip(plan.ranks, doc["ranks"], strict=True):
        path = tmp_path / rank_file_name(rp.rank, 4)
        blob = path.read_bytes()
        assert len(blob) == rp.size == entry["bytes"] == os.path.getsize(path)
        assert blob[: len(rp.header)] == rp.header and entry["header_bytes"] == len(rp.header)
        # an independent reading of the header: u64 length, JSON
        (n,) = struct.unpack("<Q", blob[:8])
        assert 8 + n == len(rp.header) and n % 8 == 0
        header = json.loads(blob[8 : 8 + n])
        header.pop("__metadata__")
        assert {name: e["data_offsets"] for name, e in header.items()} == {
            t.name: [t.begin, t.end] for t in rp.tensors
        } == {t["name"]: t["data_offsets"] for t in entry["tensors"]}
        assert max(e["data_offsets"][1] for e in header.values()) == len(blob) - 8 - n
        with safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == sorted(t.name for t in rp.tensors)
            for t in rp.tensors:
                sl = f.get_slice(t.name)
                assert (tuple(sl.get_shape()), sl.get_dtype()) == (t.shape, t.dtype)


@pytest.mark.pure
@pytest.mark.parametrize("tp", [2, 4], ids=lambda tp: f"tp{tp}")
def test_stream_from_any_offset_equals_file_bytes(strided_ckpt: tuple[Path, Manifest], tmp_path: Path,
                                                  tp: int) -> None:
    root, manifest = strided_ckpt
    ckpt = Checkpoint.open(root)
    plan = make_plan(ckpt, manifest, tp)
    write_shards(ckpt, plan, tmp_path, progress=False)
    src = load_file(str(root / "model.safetensors"))
    for rp in plan.ranks:
        blob = (tmp_path / rank_file_name(rp.rank, tp)).read_bytes()
        got = load_file(str(tmp_path / rank_file_name(rp.rank, tp)))
        assert_same(got["narrow.weight"], torch.chunk(src["narrow.weight"], tp, 1)[rp.rank])
        assert_same(got["wide.weight"], torch.chunk(src["wide.weight"], tp, 1)[rp.rank])
        header_end, size = len(rp.header), rp.size
        cuts = [(0, size), (0, 3), (5, header_end + 1), (header_end - 1, header_end + 1000),
                (header_end + 129, size - 77), (size - 1, size), (size, size), (size // 3, size // 3 + 300_001)]
        with RankStream(rp, chunk_size=4099) as stream:
            assert stream.size == size
            for start, end in cuts:
                assert b"".join(stream.chunks(start, end)) == blob[start:end], (start, end)
            views = [bytes(v) for v in stream.chunks(7, size, reuse=True)]
            assert b"".join(views) == blob[7:]
            assert all(len(v) <= 4099 for v in views)
            with pytest.raises(ValueError):
                next(stream.chunks(0, size + 1))


@pytest.mark.pure
def test_rank_files_cycle_a_few_huge_page_aligned_buffers(strided_ckpt: tuple[Path, Manifest], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers of 16 KiB, so that every rank file goes through its buffers many times: the four files,
    two at once, are assembled in at most 2 x BUFFERS buffers (lent from file to file), each starting
    on a huge-page boundary (the O_DIRECT writes then reach the disk as large requests), and every
    file still holds torch.chunk's slices and the sha256 reshard.json records."""
    root, manifest = strided_ckpt
    ckpt = Checkpoint.open(root)
    plan = make_plan(ckpt, manifest, 4)
    monkeypatch.setattr(outfile, "SPAN", 16 << 10)
    monkeypatch.setattr(outfile, "FILL", 4 << 10)
    lent: list[memoryview] = []
    take = outfile.Buffers.take
    monkeypatch.setattr(outfile.Buffers, "take", lambda self: lent.append(take(self)) or lent[-1])
    record = write_shards(ckpt, plan, tmp_path, progress=False, writers=2)
    assert all(rp.size > 4 * outfile.SPAN for rp in plan.ranks)  # each file cycles its buffers
    assert len(lent) == 4 * outfile.BUFFERS
    buffers = {id(buf.obj): buf for buf in lent}
    assert len(buffers) <= 2 * outfile.BUFFERS
    assert all(len(buf) == outfile.SPAN and ctypes.addressof(ctypes.c_char.from_buffer(buf)) % outfile.HUGE == 0
               for buf in buffers.values())
    src = load_file(str(root / "model.safetensors"))
    for rp in plan.ranks:
        path = tmp_path / rank_file_name(rp.rank, 4)
        got = load_file(str(path))
        assert_same(got["narrow.weight"], torch.chunk(src["narrow.weight"], 4, 1)[rp.rank])
        assert_same(got["wide.weight"], torch.chunk(src["wide.weight"], 4, 1)[rp.rank])
        assert record["files"][path.name]["sha256"] == sha256_file(path)


@pytest.mark.multiproc
def test_two_writes_and_another_process_are_byte_identical(hf_ckpt: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    for out in ("a", "b"):
        rc, _, err = run_cli(["write", hf_ckpt, "--tp", 4, "-o", tmp_path / out], capsys)
        assert (rc, err) == (0, "")
    proc = subprocess.run(
        [sys.executable, "-m", "reshard.cli", "write", str(hf_ckpt), "--tp", "4", "-o", str(tmp_path / "c")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted([rank_file_name(r, 4) for r in range(4)] + ["reshard.json", "config.json"])
    for out in ("b", "c"):
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == names
        for name in names:
            assert (tmp_path / out / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), (out, name)
    # writing again into the same directory changes nothing
    before = {n: (tmp_path / "a" / n).read_bytes() for n in names}
    rc, _, _ = run_cli(["write", hf_ckpt, "--tp", 4, "-o", tmp_path / "a"], capsys)
    assert rc == 0 and {n: (tmp_path / "a" / n).read_bytes() for n in names} == before


@pytest.mark.pure
def test_source_changed_after_planning_fails_and_leaves_nothing(strided_ckpt: tuple[Path, Manifest],
                                                                tmp_path: Path) -> None:
    root, manifest = strided_ckpt
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes((root / "model.safetensors").read_bytes())
    ckpt = Checkpoint.open(src)
    plan = make_plan(ckpt, manifest, 2)
    st = os.stat(src / "model.safetensors")
    os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(SourceChangedError, match="changed since it was planned"):
        write_shards(ckpt, plan, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # the directory it made is removed: nothing was published


@pytest.mark.multiproc
def test_killed_write_leaves_no_partial_file_and_rerun_completes(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL mid-write: only a temp file is left (never a final name); a rerun cleans it and finishes."""
    rows, cols = 8192, 6400  # int32: 200 MiB; row split at tp=2 gathers 12.5 KiB runs
    full = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    ckpt = tmp_path / "big"
    ckpt.mkdir()
    save_file({"big.weight": full, "norm.weight": torch.arange(cols, dtype=torch.int32)},
              str(ckpt / "model.safetensors"))
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - pattern: big.weight\n    kind: row\n")
    out = tmp_path / "out"
    argv = ["write", str(ckpt), "--tp", "2", "--rules", str(rules), "-o", str(out), "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "reshard.cli", *argv], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while not (out.is_dir() and any(p.name.startswith(TMP_PREFIX) for p in out.iterdir())):
            assert proc.poll() is None, f"writer ended before a temp file appeared: {proc.stderr.read()}"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in out.iterdir())
    assert any(n.startswith(f"{TMP_PREFIX}{proc.pid}-") for n in left), left
    assert not (out / "reshard.json").exists()
    expected = [torch.chunk(full, 2, 1)[r] for r in range(2)]
    for r in range(2):  # a final name, if any, only ever holds a complete, correct file
        final = out / rank_file_name(r, 2)
        if final.exists():
            assert_same(load_file(str(final))["big.weight"], expected[r])

    rc, _, err = run_cli(argv, capsys)
    assert (rc, err) == (0, "")
    names = sorted(p.name for p in out.iterdir())
    assert names == [rank_file_name(0, 2), rank_file_name(1, 2), "reshard.json"], names
    record = json.loads((out / "reshard.json").read_text())
    for r in range(2):
        path = out / rank_file_name(r, 2)
        assert record["files"][path.name] == {"rank": r, "size": path.stat().st_size, "sha256": sha256_file(path)}
        got = load_file(str(path))
        assert_same(got["big.weight"], expected[r])
        assert_same(got["norm.weight"], torch.arange(cols, dtype=torch.int32))


@pytest.mark.pure
def test_interrupt_as_a_file_completes_publishes_nothing_and_leaves_no_temp(strided_ckpt: tuple[Path, Manifest],
                                                                            tmp_path: Path) -> None:
    """SIGINT lands just as rank 0's last bytes arrive (one writer): the write stops, raises the
    interrupt, publishes nothing, and leaves neither a temp file nor the directory it made, although
    rank 0's file was complete and on its way to be published."""
    root, manifest = strided_ckpt
    ckpt = Checkpoint.open(root)
    plan = make_plan(ckpt, manifest, 2)
    seen = 0

    def on_bytes(n: int) -> None:
        nonlocal seen
        seen += n
        if seen == plan.ranks[0].size:  # in the writing thread: rank 0 is complete, not yet published
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.3)  # the main thread takes the interrupt and stops the write meanwhile

    out = tmp_path / "new" / "out"
    with stop_on_signals(), pytest.raises(Interrupted):
        write_shards(ckpt, plan, out, progress=False, writers=1, on_bytes=on_bytes)
    assert not (tmp_path / "new").exists(), sorted(str(p) for p in tmp_path.rglob("*"))
