"""Every error case of issue 37: one line naming what is wrong and the fix that works, no traceback, nothing
written. The tp values an error names are checked against planning each of them (the independent reference:
`make_plan` succeeds at exactly those); a missing package is simulated by hiding it (`sys.modules[NAME] =
None`, which `import` and `find_spec` both honour)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.errors import MissingDependencyError, PlanError
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.core import assert_one_error_line, run_cli

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 attention heads, 2 kv heads, intermediate 128."""
    config = llama_config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=1, vocab_size=256)
    return make_checkpoint(tmp_path_factory.mktemp("errors") / "ckpt", config, seed=2)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _plans(ckpt: Path, tp: int, rules: Path | None = None) -> bool:
    src, manifest = open_source(ckpt, rules=rules)
    try:
        make_plan(src, manifest, tp)
    except PlanError:
        return False
    return True


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_that_does_not_fit_names_the_tps_that_plan_and_no_rules_hint(ckpt: Path, tmp_path: Path, tp: int,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    good = [t for t in range(1, 65) if _plans(ckpt, t)]
    assert good == [1, 2, 4]  # the 4 heads decide; 128 alone would allow 8 (the old advice)
    out = tmp_path / "out"
    rc, _, err = run_cli(["write", str(ckpt), "--tp", str(tp), "-o", out], capsys)
    line = assert_one_error_line(rc, err, f"tp={tp}", "pick a tp that plans this checkpoint: 1, 2, 4 (rule ")
    assert "pad" not in line and "rules" not in line.split("(rule")[0]  # no rules file in play: no rule to edit
    assert not out.exists()


def test_with_a_rules_file_pad_is_offered_and_the_tps_are_that_files(ckpt: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {pattern: '*.down_proj.weight', kind: row}\n")
    good = [t for t in range(1, 65) if _plans(ckpt, t, rules)]
    assert good == [1, 2, 4, 8, 16, 32, 64]  # 128 columns of down_proj, every other tensor replicated
    rc, _, err = run_cli(["plan", str(ckpt), "--tp", "3", "--rules", rules], capsys)
    assert_one_error_line(rc, err, f"set `pad: true` on the rule in the rules file {rules} or pick a tp that plans "
                          "this checkpoint: 1, 2, 4, 8, 16, 32, 64 (rule '*.down_proj.weight', kind row)")
    padded = tmp_path / "padded.yaml"
    padded.write_text("rules:\n  - {pattern: '*.down_proj.weight', kind: row, pad: true}\n")
    assert _plans(ckpt, 3, padded)  # the fix offered works


def test_unsupported_url_scheme_is_named_for_sources_and_outputs(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # a URL taken for a path would create ./ftp:/...
    for argv in (["plan", "ftp://host/llama", "--tp", "2"],
                 ["write", "ftp://host/llama", "--tp", "2", "-o", "out"],
                 ["write", str(ckpt), "--tp", "2", "-o", "ftp://host/out"],
                 ["merge", "ftp://host/shards", "-o", "merged"],
                 ["pull", "ftp://host/llama", "--tp", "2", "--rank", "0"]):
        rc, out, err = run_cli(argv, capsys)
        assert_one_error_line(rc, err, "the URL scheme ftp:// is not supported; give a local path, s3://, gs://, "
                              "hf://, http(s):// or the service's http://HOST:PORT/v1/checkpoints/NAME")
        assert out == "" and list(tmp_path.iterdir()) == [], argv


def test_write_over_another_layout_is_refused_then_replaced_with_force(ckpt: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shards"
    assert run_cli(["write", str(ckpt), "--tp", "2", "-o", out, "--no-progress"], capsys)[0] == 0
    before = _tree(out)
    rc, _, err = run_cli(["write", str(ckpt), "--tp", "4", "-o", out, "--no-progress"], capsys)
    assert_one_error_line(rc, err, f"-o {out}: holds 2 rank files of tp=2, not tp=4; write into a new folder, "
                          "or add --force to replace them")
    assert _tree(out) == before  # nothing written, nothing removed
    rc, _, err = run_cli(["write", str(ckpt), "--tp", "4", "-o", out, "--no-progress", "--force"], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.glob("rank-*")) == [f"rank-0000{r}-of-00004.safetensors" for r in range(4)]
    fresh = tmp_path / "fresh"
    assert run_cli(["write", str(ckpt), "--tp", "4", "-o", fresh, "--no-progress"], capsys)[0] == 0
    assert _tree(out) == _tree(fresh)  # exactly what a write into a new folder gives
    rc, _, err = run_cli(["merge", out, "-o", tmp_path / "merged", "--no-progress"], capsys)
    assert rc == 0, err  # no mix of layouts left for merge to refuse


def test_same_world_other_layout_is_refused_too(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shards"
    assert run_cli(["write", str(ckpt), "--tp", "4", "-o", out, "--no-progress"], capsys)[0] == 0
    before = _tree(out)
    rc, _, err = run_cli(["write", str(ckpt), "--tp", "2", "--dp-replicate", "2", "-o", out, "--no-progress"], capsys)
    assert_one_error_line(rc, err, "holds 4 rank files of tp=4, not dp_replicate=2 x tp=2")
    assert _tree(out) == before


def test_write_into_its_source_is_refused(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(ckpt)
    rc, _, err = run_cli(["write", str(ckpt), "--tp", "2", "-o", ckpt], capsys)
    assert_one_error_line(rc, err, f"-o {ckpt}: is the source checkpoint itself; write into a new folder (or add "
                          "--force to put the rank files beside its weights)")
    assert _tree(ckpt) == before
    shards = tmp_path / "s"
    assert run_cli(["write", str(ckpt), "--tp", "2", "-o", shards, "--no-progress"], capsys)[0] == 0
    before = _tree(shards)
    for argv in (["write", shards, "--tp", "4", "-o", shards, "--force"], ["merge", shards, "-o", shards]):
        rc, _, err = run_cli(argv, capsys)  # rank files read and replaced at once: --force does not help
        assert_one_error_line(rc, err, f"-o {shards}: is the folder of the rank files being read; ")
        assert _tree(shards) == before, argv


def test_serve_without_root_names_the_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RESHARD_ROOT", raising=False)
    rc, out, err = run_cli(["serve"], capsys)
    assert_one_error_line(rc, err, "serve: no folder of checkpoints given; pass --root DIR (or set RESHARD_ROOT=DIR)")
    assert out == ""


def test_serve_on_a_taken_port_names_the_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, out, err = run_cli(["serve", "--root", tmp_path, "--port", port], capsys)
    assert rc == 3
    assert_one_error_line(rc, err, f"serve: port {port} on 127.0.0.1 is in use (another reshard serve?); pick a free "
                          "one with --port N (or RESHARD_PORT), or stop what holds it")
    assert list(tmp_path.iterdir()) == []  # no .reshard state made


def test_pull_announces_each_retry_then_gives_up_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/checkpoints/llama"
    dest = tmp_path / "new" / "r.safetensors"
    rc, out, err = run_cli(["pull", url, "--tp", "2", "--rank", "0", "--retries", "2", "-o", dest], capsys)
    lines = err.splitlines()
    assert rc == 1 and out == "" and "Traceback" not in err
    assert [line.split(";")[-1] for line in lines[:2]] == [" retry 1 of 2 in 0.25 s", " retry 2 of 2 in 0.5 s"]
    assert all(line.startswith(f"reshard: warning: {url}: ") and "Connection refused" in line for line in lines[:2])
    assert lines[2:] == [f"reshard: error: {url}: giving up after 2 retries: [Errno 111] Connection refused"]
    assert not (tmp_path / "new").exists()  # the folder pull -o would make is not left behind
    rc, _, err = run_cli(["pull", url, "--tp", "2", "--rank", "0", "--retries", "1", "--log-level", "error"], capsys)
    assert_one_error_line(rc, err, "giving up after 1 retries")  # --log-level error: the retries unannounced


def test_launch_of_a_missing_script_or_module_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["launch", "--nproc-per-node", "2", str(tmp_path / "missing.py")],
                          f"{tmp_path / 'missing.py'}: no such script; give the path of a Python file (or -m MODULE)"),
                         (["launch", "--nproc-per-node", "2", "-m", "nope.missing"],
                          "-m nope.missing: no such module here")):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 1 and out == "" and err.splitlines() == [f"reshard launch: error: {needle}" + err.split(needle, 1)[1].rstrip("\n")]


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.fill import empty_tp_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match=r"^empty_tp_model \(a transformers model\) needs transformers, "
                       r"which is not installed here; pip install 'reshard\[train\]'$"):
        empty_tp_model({"model_type": "llama"})
    rc, out, err = run_cli(["launch", "-m", "reshard.cli.train", "--shards", str(tmp_path)], capsys)
    assert rc == 1 and out == "" and err.splitlines() == [
        "reshard launch: error: the trainer (reshard launch -m reshard.cli.train) needs transformers, which is not "
        "installed here; pip install 'reshard[train]'"]
    from reshard.cli.train import main as train

    rc = train(["--shards", str(tmp_path), "--steps", "1"])
    assert rc == 1 and capsys.readouterr().err.splitlines() == [
        "reshard.cli.train: error: the trainer (python -m reshard.cli.train) needs transformers, which is not "
        "installed here; pip install 'reshard[train]'"]
    assert list(tmp_path.iterdir()) == []


def test_missing_torch_names_the_extra_for_demo_and_trainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    rc, out, err = run_cli(["demo", "--workdir", tmp_path / "demo"], capsys)
    assert_one_error_line(rc, err, "reshard demo needs torch, which is not installed here; pip install 'reshard[train]'")
    assert not (tmp_path / "demo").exists()
    monkeypatch.undo()
    hide = "import sys, runpy; sys.modules['torch'] = None; runpy.run_module('reshard.cli.train', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", hide, "--shards", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["reshard.cli.train: error: the trainer (python -m reshard.cli.train) needs torch, "
                                        "which is not installed here; pip install 'reshard[train]'"]


def test_trainer_with_a_missing_source_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.cli.train import main as train

    monkeypatch.chdir(tmp_path)
    assert train(["--shards", "nope", "--steps", "1"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("reshard.cli.train: error: nope: no such ") and "no ranks" not in err[0]
    from reshard.errors import CheckpointError
    from reshard.fill.open import open_rank_stream

    with pytest.raises(CheckpointError, match=r"^nope: no such directory or rank file; give a directory of rank files"):
        open_rank_stream("nope", 0, 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"\(there are no rank files here\); run `reshard write"):
        open_rank_stream(tmp_path / "empty", 0, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
