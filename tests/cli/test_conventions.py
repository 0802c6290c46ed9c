"""What every `reshard` command shares (reshard.cli.common): `--version` with the libraries as installed,
`--debug` and `--log-level` anywhere on the line, examples at the end of every `--help`, `--json` on every
command that reports a result (parsed, its values checked against the files on disk and the library's own
plan), results on stdout and diagnostics on stderr, and the shell completion script."""

from __future__ import annotations

import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

from reshard.cli import build_parser
from reshard.cli.completion import SHELLS, shell_code
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.types import plan_to_json
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.core import assert_one_error_line, run_cli, sha256_file

pytestmark = pytest.mark.pure

COMMANDS = ("plan", "write", "merge", "pull", "serve", "demo", "launch", "completion")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 attention heads, 2 kv heads, intermediate 128: tp 1, 2 and 4 plan it."""
    config = llama_config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=1, vocab_size=256)
    root = make_checkpoint(tmp_path_factory.mktemp("conv") / "ckpt", config, seed=1)
    (root / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "do_sample": False}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return root


def test_version_names_reshard_python_torch_and_transformers_as_installed(capsys: pytest.CaptureFixture[str]) -> None:
    import reshard

    with pytest.raises(SystemExit) as e:
        run_cli(["--version"], capsys)
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"reshard {reshard.__version__}"
    assert lines[1].startswith(f"python {sys.version.split()[0]} ")
    seen = dict(line.split(" ", 1) for line in lines[2:])
    for name in ("torch", "transformers", "safetensors", "vllm"):
        try:
            want = metadata.version(name)
        except metadata.PackageNotFoundError:
            want = "not installed"
        assert seen[name] == want, (name, seen)


def test_version_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    import subprocess

    code = ("import sys\nfrom reshard.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_and_log_level_are_taken_anywhere_on_the_line(ckpt: Path, where: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--debug", "--log-level", "ERROR"]
    argv = [*flags, "plan", str(ckpt), "--tp", "3"] if where == "before" else ["plan", str(ckpt), "--tp", "3", *flags]
    args = build_parser().parse_args(argv)
    assert args.debug is True and args.log_level == "error"
    from reshard.errors import PlanError

    with pytest.raises(PlanError):  # --debug: the error itself, with its traceback, not the one line
        run_cli(argv, capsys)


def test_log_level_error_hides_warnings_but_not_the_result(ckpt: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {pattern: '*.q_proj.weight', kind: column}\n  - {pattern: 'nothing.*', kind: column}\n")
    rc, out, err = run_cli(["plan", str(ckpt), "--tp", "2", "--rules", rules], capsys)
    assert rc == 0 and err == "reshard: warning: rule 'nothing.*' (column) matches no tensor\n", err
    assert out.startswith(f"checkpoint: {ckpt} ")
    rc, out2, err = run_cli(["plan", str(ckpt), "--tp", "2", "--rules", rules, "--log-level", "error"], capsys)
    assert rc == 0 and err == "" and out2 == out


@pytest.mark.parametrize("name", COMMANDS)
def test_every_help_ends_with_examples_of_that_command(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        run_cli([name, "--help"], capsys)
    assert e.value.code == 0
    out = capsys.readouterr().out
    tail = out[out.rindex("examples:"):].splitlines()[1:]
    assert len(tail) >= 2 and all(line.strip().startswith(("reshard ", "eval ", "RESHARD_")) for line in tail), tail
    assert any(f"reshard {name}" in line for line in tail), tail
    assert "--debug" in out and "--log-level" in out


def test_top_help_lists_every_command_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_cli(["--help"], capsys)
    out = capsys.readouterr().out
    assert "examples:" in out and "--version" in out
    for name in COMMANDS:
        assert name in out


def test_plan_json_is_the_librarys_plan(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["plan", str(ckpt), "--tp", "2", "--json"], capsys)
    assert rc == 0 and err == ""
    src, manifest = open_source(ckpt)
    assert json.loads(out) == plan_to_json(make_plan(src, manifest, 2), tensors=True)


def test_write_json_lists_the_files_as_on_disk(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "a" / "b" / "shards"  # missing parents are made, as for pull -o
    rc, out, err = run_cli(["write", str(ckpt), "--tp", "2", "-o", out_dir, "--no-progress", "--json"], capsys)
    assert rc == 0 and err == ""
    got = json.loads(out)
    on_disk = {p.name: p for p in out_dir.glob("rank-*.safetensors")}
    assert set(got["files"]) == set(on_disk) == {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"}
    for name, f in got["files"].items():
        assert f["size"] == on_disk[name].stat().st_size and f["sha256"] == sha256_file(on_disk[name])
    assert got["bytes"] == sum(p.stat().st_size for p in on_disk.values())
    assert got["written"] == [0, 1] and got["kept"] == [] and got["tp"] == 2
    assert got["plan"] == json.loads((out_dir / "reshard.json").read_text())["plan"]
    rc, out, _ = run_cli(["write", str(ckpt), "--tp", "2", "-o", out_dir, "--no-progress", "--json"], capsys)
    assert rc == 0 and json.loads(out)["kept"] == [0, 1] and json.loads(out)["written"] == []


def test_merge_json_and_the_small_files_kept(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "shards"
    assert run_cli(["write", str(ckpt), "--tp", "2", "-o", shards, "--no-progress"], capsys)[0] == 0
    for name in ("generation_config.json", "tokenizer_config.json", "config.json"):  # write carries them along
        assert (shards / name).read_bytes() == (ckpt / name).read_bytes(), name
    rc, out, err = run_cli(["merge", shards, "-o", tmp_path / "merged", "--json", "--no-progress"], capsys)
    assert rc == 0 and err == ""
    got = json.loads(out)
    assert got["kept"] == ["config.json", "generation_config.json", "tokenizer_config.json"]
    for name in got["kept"]:  # the merge keeps every small file of its source, byte for byte
        assert (tmp_path / "merged" / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert got["files"] == ["model.safetensors"] and got["tp"] == 2
    src = open_source(ckpt)[0]
    assert got["tensors"] == len(src.tensors) and got["bytes"] == src.total_bytes()
    from safetensors.torch import load_file

    want, have = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    assert set(want) == set(have) and all(bool((want[k] == have[k]).all()) for k in want)


def test_merge_keeps_what_the_library_merge_keeps(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "s"
    assert run_cli(["write", str(ckpt), "--tp", "4", "-o", shards, "--no-progress"], capsys)[0] == 0
    (shards / "tokenizer_config.json").unlink()  # only what is there is kept
    summary = merge(shards, tmp_path / "m", progress=False)
    assert summary["kept"] == ["config.json", "generation_config.json"]
    assert not (tmp_path / "m" / "tokenizer_config.json").exists()


def test_pull_from_a_path_is_the_rank_file_write_writes(ckpt: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "w"
    assert run_cli(["write", str(ckpt), "--tp", "2", "-o", shards, "--no-progress"], capsys)[0] == 0
    dest = tmp_path / "new" / "dir" / "r1.safetensors"  # its folder is made, as write -o makes its own
    rc, out, err = run_cli(["pull", str(ckpt), "--tp", "2", "--rank", "1", "-o", dest, "--no-progress", "--json"], capsys)
    assert rc == 0 and err == ""
    got = json.loads(out)
    want = (shards / "rank-00001-of-00002.safetensors").read_bytes()
    assert dest.read_bytes() == want
    assert got["sha256"] == hashlib.sha256(want).hexdigest() and got["size"] == len(want) and got["rank"] == 1
    rc, out, err = run_cli(["pull", str(ckpt), "--meta", "-o", tmp_path / "meta", "--json"], capsys)
    assert rc == 0 and err == ""
    names = [f["name"] for f in json.loads(out)["files"]]
    assert names == ["config.json", "generation_config.json", "tokenizer_config.json"]
    assert all((tmp_path / "meta" / n).read_bytes() == (ckpt / n).read_bytes() for n in names)


def test_results_on_stdout_diagnostics_on_stderr(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["write", str(ckpt), "--tp", "2", "-o", tmp_path / "o", "--no-progress"],
                 ["merge", tmp_path / "o", "-o", tmp_path / "m", "--no-progress"],
                 ["pull", str(ckpt), "--tp", "2", "--rank", "0", "-o", tmp_path / "r0.safetensors", "--no-progress"],
                 ["plan", str(ckpt), "--tp", "4"]):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 0 and err == "" and out.strip(), (argv, out, err)
    rc, out, err = run_cli(["plan", str(ckpt), "--tp", "3"], capsys)
    assert out == ""
    assert_one_error_line(rc, err, "pick a tp that plans this checkpoint: 1, 2, 4")


@pytest.mark.parametrize("shell", SHELLS)
def test_completion_script_registers_reshard(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["completion", shell], capsys)
    assert rc == 0 and err == "" and out == shell_code(shell)
    import argcomplete

    assert out == argcomplete.shellcode(["reshard"], shell=shell)
    assert {"bash": "complete -o nospace -o default -o bashdefault -F _python_argcomplete reshard",
            "zsh": "compdef _python_argcomplete reshard", "fish": "complete --command reshard"}[shell] in out
