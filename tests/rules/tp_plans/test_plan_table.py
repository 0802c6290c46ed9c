"""The shipped plan table is transformers' plans: every architecture, the same manifest, its source named."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from reshard.errors import ManifestError
from reshard.rules.from_config import from_config
from reshard.rules.tp_plans import SOURCE_ENV, live_entry, load_table, table_entry
from reshard.rules.tp_plans.live import plan_model_types
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.core import assert_one_error_line, run_cli

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _manifest_or_error(config: dict, names: list[str]) -> object:
    try:
        return from_config(config, names).to_dict()
    except ManifestError as e:
        return f"error: {e}"


# the table is one release's plans (constraints.txt pins it); the newest-versions lane installs another
TABLE_RELEASE = load_table()["transformers_version"] == transformers.__version__
OTHER_RELEASE = f"the shipped table is transformers {load_table()['transformers_version']}'s plans, not {transformers.__version__}'s"


@pytest.mark.pure
def test_table_covers_every_architecture_with_a_plan() -> None:
    """The shipped table is what scripts/gen_plan_table.py makes from the installed transformers, byte for byte,
    and names every model_type whose config class declares a base_model_tp_plan."""
    if not TABLE_RELEASE:
        pytest.skip(f"{OTHER_RELEASE}: it is checked against its own release in the pinned lane")
    gen = importlib.import_module("scripts.gen_plan_table")
    table = load_table()
    declared = plan_model_types()
    assert len(declared) > 100
    assert sorted(table["plans"]) == sorted(declared)
    assert gen.main(["--check"]) == 0


@pytest.mark.pure
def test_table_gives_the_same_manifest_as_live_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """For every architecture: the same entry, and the same manifest (no error) from config.json (its class
    defaults) and names standing for each plan key, with transformers read live and with the table alone.
    Under another release than the table's (the newest-versions lane): every architecture of the installed
    transformers plans from its live plans (a style reshard cannot honour shows up here)."""
    for model_type in load_table()["plans"] if TABLE_RELEASE else plan_model_types():
        live = live_entry(model_type)
        assert live is not None, model_type
        config = {"model_type": model_type, **live.defaults}
        names = live.stand_in_names()
        monkeypatch.setenv(SOURCE_ENV, "live")
        got_live = _manifest_or_error(config, names)
        assert not isinstance(got_live, str), got_live  # every architecture plans (with its config's defaults)
        if TABLE_RELEASE:
            shipped = table_entry(model_type)
            assert shipped is not None and live.to_dict() == shipped.to_dict(), model_type
            monkeypatch.setenv(SOURCE_ENV, "table")
            assert _manifest_or_error(config, names) == got_live, model_type


@pytest.mark.multiproc
def test_plan_names_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", llama_config(model_type="mistral", **SIZES), num_files=2, seed=3)
    rc, out, err = run_cli(["plan", ckpt, "--tp", 2], capsys)
    assert (rc, err) == (0, "")
    assert (f"manifest:   transformers {transformers.__version__} plan for model_type 'mistral' "
            f"(the shipped table of that version)") in out
    monkeypatch.setenv(SOURCE_ENV, "live")
    rc, out_live, err = run_cli(["plan", ckpt, "--tp", 2, "--json"], capsys)
    assert (rc, err) == (0, "")
    assert json.loads(out_live)["manifest_source"] == f"transformers {transformers.__version__} plan for model_type 'mistral'"
    monkeypatch.setenv(SOURCE_ENV, "table")
    rc, out_table, err = run_cli(["plan", ckpt, "--tp", 2, "--json"], capsys)
    assert (rc, err) == (0, "")
    doc = json.loads(out_table)  # the default: the table, named as that version's plan when the versions agree
    assert doc["manifest_source"] == (f"transformers {transformers.__version__} plan for model_type 'mistral' "
                                      f"(the shipped table of that version)")
    # without transformers importable at all, the table plans the same ranks
    code = ("import sys; sys.modules['transformers'] = None; from reshard.cli import main; "
            f"sys.exit(main(['plan', {str(ckpt)!r}, '--tp', '2', '--json']))")
    monkeypatch.delenv(SOURCE_ENV)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    blocked = json.loads(proc.stdout)
    assert "shipped table" in blocked.pop("manifest_source")
    assert blocked == {k: v for k, v in doc.items() if k != "manifest_source"}
    assert json.loads(out_live)["ranks"] == doc["ranks"]
    # a rules file in the directory wins over every plan
    (ckpt / "reshard-rules.yaml").write_text("rules:\n  - {pattern: 'model.norm.weight', kind: replicate}\n")
    rc, out, err = run_cli(["plan", ckpt, "--tp", 2], capsys)
    assert (rc, err) == (0, "") and f"rules file {ckpt / 'reshard-rules.yaml'}" in out


@pytest.mark.pure
def test_no_plan_anywhere_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", llama_config(model_type="llama", **SIZES), num_files=1, seed=4)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    rc, _, err = run_cli(["plan", ckpt, "--tp", 2], capsys)
    assert_one_error_line(rc, err, "model_type 'bert' has no TP plan anywhere", "write a rules file",
                          "reshard-rules.yaml", "--rules FILE")


@pytest.mark.pure
def test_unhonourable_style_names_style_key_and_architecture() -> None:
    config = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 16,
              "base_model_tp_plan": {"layers.*.mlp.up_proj": "colwise_magic"}}
    with pytest.raises(ManifestError, match=r"model_type 'llama': TP plan entry 'layers\.\*\.mlp\.up_proj' uses style "
                                             r"'colwise_magic', which reshard cannot honour"):
        from_config(config, ["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.pure
def test_conversion_ops_reshard_cannot_follow_are_errors() -> None:
    """A sharded parameter built from disk through an op reshard does not model (a transpose) is an error, not
    a split of the wrong dim; the same op on a replicated parameter is fine."""
    from reshard.rules.tp_plans.derive import PlanRules
    from reshard.rules.tp_plans.entry import PlanEntry

    entry = PlanEntry(model_type="toy", base_plan={"layers.*.mlp.up_proj": "colwise"}, conversion=[
        {"type": "convert", "source": ["mlp.w_up.weight"], "target": ["mlp.up_proj.weight"], "ops": [["Transpose", None]]},
        {"type": "convert", "source": ["norm.w"], "target": ["norm.weight"], "ops": [["Transpose", None]]},
    ])
    rules = PlanRules(entry, {})
    assert rules.kind_for("model.norm.w") is None
    with pytest.raises(ManifestError, match=r"model_type 'toy': model\.layers\.0\.mlp\.w_up\.weight becomes "
                                             r"model\.layers\.0\.mlp\.up_proj\.weight through transformers' "
                                             r"conversion ops \['Transpose'\], which reshard cannot follow"):
        rules.kind_for("model.layers.0.mlp.w_up.weight")
