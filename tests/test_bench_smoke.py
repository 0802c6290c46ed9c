"""Smoke test of the benchmark harness on a tiny checkpoint: results JSON, chart and table, no timings asserted;
`python -m bench list` / `python -m bench NAME` reach every comparison."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench import commands, data, run
from bench.baselines import chunk_script, slice_script
from bench.compare_write import SAME_WORK, memory_summary, write_cases
from bench.interleave import interleave
from bench.measure import run_command
from bench.report import save
from bench.targets import evaluate

MiB = 1 << 20
BENCH = Path(commands.__file__).resolve().parent


@pytest.mark.multiproc
def test_sampler_sums_rss_anon_over_the_process_tree() -> None:
    alloc = "import time; b = bytearray(48 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.4)"
    one = run_command("one", [sys.executable, "-c", alloc])
    two = run_command("two", ["sh", "-c", f'"{sys.executable}" -c "{alloc}" & "{sys.executable}" -c "{alloc}"; wait'])
    assert one.returncode == 0 and one.samples > 3
    assert 48 * MiB <= one.peak_rss_anon < 200 * MiB
    assert two.peak_rss_anon >= 96 * MiB


@pytest.mark.multiproc
def test_failed_command_raises_with_its_stderr() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        run_command("bad", [sys.executable, "-c", "import sys; sys.exit('boom')"])


@pytest.mark.pure
@pytest.mark.parametrize("tp", [2, 4])
def test_baseline_scripts_write_the_same_tensors_as_reshard(tmp_path: Path, tp: int) -> None:
    from reshard.io.sinks.write import write_shards
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    src = data.checkpoint("tiny", root=tmp_path)
    ckpt, manifest = open_source(src)
    write_shards(ckpt, make_plan(ckpt, manifest, tp), tmp_path / "reshard", progress=False)
    for method, script in (("chunk", chunk_script), ("slice", slice_script)):
        out = tmp_path / method
        out.mkdir()
        script(src, out, tp)
        for rank in range(tp):
            name = f"rank-{rank:05d}-of-{tp:05d}.safetensors"
            ours, theirs = load_file(tmp_path / "reshard" / name), load_file(out / name)
            assert set(ours) == set(theirs)
            for k in ours:
                assert torch.equal(ours[k], theirs[k]), (method, rank, k)


@pytest.mark.multiproc
def test_interleaved_write_comparison_produces_results(tmp_path: Path) -> None:
    src = data.checkpoint("tiny", root=tmp_path / "data")
    assert (src / "model.safetensors.index.json").exists()
    cases = write_cases(src, tmp_path / "work", 2, scripts=False)
    res = interleave("write tiny tp2", cases, reps=2, warmup=0, baseline="cp -r", log=lambda s: None)
    res.update(checkpoint="1gb", checkpoint_bytes=data.weight_bytes(src), tp=4)
    assert res["baseline"] == "cp -r"
    assert set(res["cases"]) >= {"cp -r", SAME_WORK, "reshard write --tp 2"}
    for case in res["cases"].values():
        assert len(case["runs"]) == 2
        assert {"median_s", "ratio_to_baseline", "peak_rss_anon_mib", "runs", "argv"} <= set(case)
        assert case["median_s"] > 0
    assert res["cases"]["cp -r"]["ratio_to_baseline"] == 1.0
    assert res["cases"]["reshard write --tp 2"]["peak_rss_anon_mib"] > 1  # a python process, not a no-op
    assert not (tmp_path / "work" / "reshard-tp2").exists()  # outputs are removed after each run

    results = {"meta": {"mode": "smoke", "date": "today", "machine": "test", "reps": 2},
               "comparisons": [res], "memory": memory_summary([res])}
    results["targets"] = evaluate(results)
    paths = save(results, tmp_path / "results")
    loaded = json.loads(paths["json"].read_text())
    assert {"meta", "comparisons", "memory", "targets"} <= set(loaded)
    assert {t["target"].split(",")[0] for t in loaded["targets"]} >= {
        "`reshard write --tp 4` vs `cp -r`", "`reshard write --tp 4` vs `cp -r` + `sync` + `sha256sum` (the same work)"}
    assert paths["png"].stat().st_size > 1000
    table = paths["md"].read_text()
    assert "| write tiny tp2 | reshard write --tp 2 |" in table
    assert "| write tiny tp2 | cp -r | " in table


@pytest.mark.pure
def test_every_comparison_file_is_a_command_named_after_it() -> None:
    files = sorted(p.stem for p in BENCH.glob("compare_*.py"))
    assert len(files) == 13
    assert {n: m for n, m in commands.COMMANDS.items() if m.startswith("compare_")} == {
        f.removeprefix("compare_"): f for f in files}
    assert all((BENCH / f"{m}.py").is_file() for m in commands.COMMANDS.values())


@pytest.mark.pure
def test_the_readme_names_every_entry_point() -> None:
    """Every bench module runnable as `python -m bench.MODULE` is in bench/README.md, and every command."""
    mains = sorted(p.stem for p in BENCH.glob("*.py") if any(
        isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in ast.parse(p.read_text()).body))
    assert {"run", "compare_write", "baselines", "fill_worker", "vllm_worker", "gather"} <= set(mains)
    readme = (BENCH / "README.md").read_text()
    assert [m for m in mains if f"`{m}.py`" not in readme and m != "run"] == []
    assert [n for n in commands.COMMANDS if f"| `{n}` |" not in readme] == []


@pytest.mark.pure
def test_list_prints_every_command_with_its_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.dispatch(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "python -m bench NAME [ARGS]:"
    assert [ln.split()[:4] for ln in lines[1:]] == [
        [n, "python", "-m", f"bench.{m}"] for n, m in commands.COMMANDS.items()]
    assert lines[1 + list(commands.COMMANDS).index("gather")].endswith(
        "`python -m bench.gather [--reps 7]`: gathering strided runs (a row-split tensor's slice), two ways.")


@pytest.mark.pure
def test_a_name_runs_that_modules_main_and_the_rest_is_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import gather

    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(gather, "main", lambda argv: calls.append(("gather", argv)) or 3)
    monkeypatch.setattr(run, "main", lambda argv: calls.append(("suite", argv)) or 0)
    assert commands.dispatch(["gather", "--reps", "2"]) == 3
    assert commands.dispatch(["plan", "--reps", "1"]) == 0  # no main of its own: the suite with --only
    assert commands.dispatch(["--full", "--only", "write"]) == 0
    assert commands.dispatch([]) == 0
    assert calls == [("gather", ["--reps", "2"]), ("suite", ["--only", "plan", "--reps", "1"]),
                     ("suite", ["--full", "--only", "write"]), ("suite", [])]
    with pytest.raises(SystemExit, match="no command 'nope'; known: list, write, serve, train, plan"):
        commands.dispatch(["nope"])


@pytest.mark.pure
def test_checkpoint_bench_places_each_tensor_as_its_rank_header_cuts_it() -> None:
    """bench/compare_checkpoint's DTensors: Shard(d) where the rank holds its even slice of dim d, else Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    from bench.checkpoint_worker import placement

    column = {"kind": "column", "shape": [8, 4], "select": [[[4, 8]], [[0, 4]]]}
    row = {"kind": "row", "shape": [8, 4], "select": [[[0, 8]], [[0, 2]]]}
    norm = {"kind": "replicate", "shape": [4], "select": [[[0, 4]]]}
    assert (placement(column, 2, 1), placement(row, 2, 0), placement(norm, 2, 1)) == (Shard(0), Shard(1), Replicate())
    with pytest.raises(SystemExit, match="not one even slice"):
        placement({"kind": "vocab_embed", "shape": [7, 4], "select": [[[4, 7]], [[0, 4]]]}, 2, 1)  # padded


@pytest.mark.multiproc
def test_dcp_merge_bench_checks_what_each_command_wrote(tmp_path: Path) -> None:
    """bench/compare_dcp_merge on the tiny checkpoint: saved by 2 torchrun ranks both ways, every command's
    output holds the checkpoint's tensors (checked after the warm-up), a targets table."""
    from bench import compare_dcp_merge as m

    res = m.run("tiny", 1, tmp_path / "work", root=tmp_path / "data")
    assert [sorted(c["cases"]) for c in res["comparisons"]] == [sorted([m.RESHARD, m.TORCH]), sorted([m.RESHARD, m.TRANSFORMERS])]
    assert res["checked"] and all(res["checked"].values()) and len(res["checked"]) == 4
    assert sorted(p.name for p in (tmp_path / "data" / "llama-dcp-tiny-dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "bench-ckpt.json", "config.json"]
    assert "| dcp.save directory | reshard merge |" in m.markdown(res)
    assert not (tmp_path / "work").exists()
