"""Bad input: malformed headers, inconsistent checkpoints, wrong manifests and impossible tp.

Each case builds a source on disk and names the exact error class and message fragments. Every case
runs twice: through the library (open_source + make_plan) and through `reshard plan` / `reshard write`,
which must exit non-zero with exactly one `reshard: error: ...` line, no traceback, and (for write)
no output directory at all.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.cli.commands import parse_ranks
from reshard.errors import (
    CheckpointError,
    HeaderError,
    ManifestError,
    PlanError,
    RegistryError,
    ReshardError,
)
from reshard.format.checkpoint import MAX_HEADER_BYTES, Checkpoint, parse_header, read_header
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.plan.types import check_tp
from reshard.rules.manifest import Manifest
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.core import (
    assert_one_error_line,
    entry,
    raw_safetensors,
    run_cli,
    save_checkpoint,
    valid_file_bytes,
    write_file,
)

REPO = Path(__file__).resolve().parents[2]
BUILTIN_KINDS = ["column", "packed_column", "replicate", "row", "vocab_embed"]


@dataclass
class Source:
    """What a case hands to the library and the CLI."""

    path: Path
    rules: Path | None = None
    tp: int = 2
    strict: bool = False
    ranks: str | None = None


CASES: list = []


def case(case_id: str, cls: type[ReshardError], *needles: str) -> Callable:
    def deco(build: Callable[[Path], Source]) -> Callable[[Path], Source]:
        CASES.append(pytest.param(build, cls, needles, id=case_id))
        return build

    return deco


# --- malformed headers: one file, model.safetensors ---------------------------------------------------

F32_22 = {"a": entry("F32", [2, 2], 0)}  # 16 data bytes
HEADER_CASES: list[tuple[str, bytes, tuple[str, ...]]] = [
    ("header-len-huge", raw_safetensors(b"{}", length=2**63), (f"exceeds the {MAX_HEADER_BYTES}-byte limit",)),
    ("header-len-limit+1", raw_safetensors(b"{}", length=MAX_HEADER_BYTES + 1), ("exceeds the",)),
    ("header-len-past-eof", raw_safetensors(b"{}", length=1000), ("header length 1000 runs past the end of the 10-byte file",)),
    ("header-len-zero", raw_safetensors(b"", b"\0" * 16, length=0), ("header length is 0",)),
    ("file-3-bytes", b"\x01\x02\x03", ("file is 3 bytes, too short for the 8-byte header length",)),
    ("file-empty", b"", ("file is 0 bytes",)),
    ("header-cut-short", valid_file_bytes()[:30], ("runs past the end of the 30-byte file (truncated?)",)),
    ("header-not-utf8", raw_safetensors(b'{"\xff\xfe": 1}'), ("header is not valid UTF-8 (byte 2)",)),
    ("header-not-json", raw_safetensors(b'{"a": '), ("header is not valid JSON",)),
    ("header-deep-nesting", raw_safetensors(b"[" * 100_000), ("header is not valid JSON",)),
    ("header-json-list", raw_safetensors(b"[1, 2]"), ("header is a JSON list, not an object",)),
    ("header-json-string", raw_safetensors(b'"hi"'), ("header is a JSON str, not an object",)),
    ("duplicate-name", raw_safetensors(
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8), ("duplicate name 'a'",)),
    ("nul-in-name", raw_safetensors({"a\x00b": entry("F32", [1], 0)}, b"\0" * 4), ("contains a NUL byte",)),
    ("lone-surrogate-name", raw_safetensors(
        b'{"a\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
     ("is not valid Unicode",)),
    ("unknown-dtype", raw_safetensors({"a": entry("F32", [1], 0) | {"dtype": "F128"}}, b"\0" * 4),
     ("tensor 'a': unknown dtype 'F128'; known: BOOL",)),
    ("shape-negative", raw_safetensors({"a": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 0]}}),
     ("shape [-1, 4] must be a list of non-negative integers",)),
    ("shape-float", raw_safetensors({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8),
     ("shape [2.0] must be a list of non-negative integers",)),
    ("shape-bool", raw_safetensors({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"),
     ("shape [True] must be a list",)),
    ("shape-overflow", raw_safetensors({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}},
                                       b"\0" * 16), ("is absurdly large (1208925819614629174706176 elements)",)),
    ("bytes-not-matching-shape", raw_safetensors({"a": entry("F32", [2, 2], 0, 12)}, b"\0" * 12),
     ("tensor 'a': 12 bytes in data_offsets [0, 12] but shape [2, 2] x F32 needs 16",)),
    ("offsets-overlap", raw_safetensors(F32_22 | {"b": entry("F32", [2, 2], 8)}, b"\0" * 24),
     ("tensor 'b': data_offsets [8, 24] overlap 'a' (which ends at 16)",)),
    ("offsets-hole", raw_safetensors(F32_22 | {"b": entry("F32", [2, 2], 20)}, b"\0" * 36),
     ("tensor 'b': hole of 4 bytes before it (data_offsets start at 20, expected 16)",)),
    ("offsets-not-from-0", raw_safetensors({"a": entry("F32", [2, 2], 8)}, b"\0" * 24),
     ("tensor 'a': hole of 8 bytes before it (data_offsets start at 8, expected 0)",)),
    ("offsets-reversed", raw_safetensors({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}),
     ("data_offsets [4, 0] must be two non-negative integers",)),
    ("offsets-three", raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\0" * 4),
     ("data_offsets [0, 4, 8] must be two",)),
    ("data-truncated-download", raw_safetensors(F32_22, b"\0" * 10),
     ("data region is 10 bytes but tensors need 16 (truncated download?)",)),
    ("data-trailing-bytes", raw_safetensors(F32_22, b"\0" * 20),
     ("4 trailing bytes after the last tensor (data region 20, tensors end at 16)",)),
    ("metadata-int-value", raw_safetensors({"__metadata__": {"format": 1}} | F32_22, b"\0" * 16),
     ("__metadata__ must map strings to strings",)),
    ("metadata-nested", raw_safetensors({"__metadata__": {"a": {"b": "c"}}} | F32_22, b"\0" * 16),
     ("__metadata__ must map strings to strings",)),
    ("metadata-list", raw_safetensors({"__metadata__": []} | F32_22, b"\0" * 16),
     ("__metadata__ must map strings to strings",)),
    ("metadata-empty-string", raw_safetensors({"__metadata__": ""} | F32_22, b"\0" * 16),
     ("__metadata__ must map strings to strings",)),
    ("entry-extra-key", raw_safetensors({"a": entry("F32", [1], 0) | {"x": 1}}, b"\0" * 4),
     ("tensor 'a': entry must have exactly dtype, shape, data_offsets",)),
    ("entry-not-object", raw_safetensors({"a": 5}), ("tensor 'a': entry must have exactly",)),
]


def _header_builder(blob: bytes) -> Callable[[Path], Source]:
    return lambda tmp: Source(write_file(tmp / "ckpt" / "model.safetensors", blob).parent)


for _id, _blob, _needles in HEADER_CASES:
    case(_id, HeaderError, "model.safetensors: ", *_needles)(_header_builder(_blob))


def _two_files(tmp: Path, index: dict | str | None) -> Path:
    root = tmp / "ckpt"
    root.mkdir()
    save_file({"a.weight": torch.zeros(4, 2)}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.zeros(4, 2)}, str(root / "model-00002-of-00002.safetensors"))
    if index is not None:
        text = index if isinstance(index, str) else json.dumps({"weight_map": index})
        (root / "model.safetensors.index.json").write_text(text)
    return root


F1, F2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


# --- checkpoints -------------------------------------------------------------------------------------

@case("header-error-in-second-file", HeaderError, F2, "trailing bytes")
def _(tmp: Path) -> Source:
    root = _two_files(tmp, {"a.weight": F1, "b.weight": F2})
    with open(root / F2, "ab") as f:
        f.write(b"junk")
    return Source(root)


@case("index-names-missing-file", CheckpointError, "model.safetensors.index.json: names file",
      "'model-00003-of-00003.safetensors', which is missing from")
def _(tmp: Path) -> Source:
    return Source(_two_files(tmp, {"a.weight": F1, "b.weight": "model-00003-of-00003.safetensors"}))


@case("index-path-outside-dir", CheckpointError, "names file '../model.safetensors'")
def _(tmp: Path) -> Source:
    save_file({"b.weight": torch.zeros(2)}, str(tmp / "model.safetensors"))
    return Source(_two_files(tmp, {"a.weight": F1, "b.weight": "../model.safetensors"}))


@case("index-tensor-in-wrong-file", CheckpointError, f"tensor 'b.weight' is not in {F1}")
def _(tmp: Path) -> Source:
    return Source(_two_files(tmp, {"a.weight": F1, "b.weight": F1}))


@case("index-tensor-in-no-file", CheckpointError, f"tensor 'ghost.weight' is not in {F2}")
def _(tmp: Path) -> Source:
    return Source(_two_files(tmp, {"a.weight": F1, "b.weight": F2, "ghost.weight": F2}))


@case("index-misses-a-tensor", CheckpointError, "does not list 1 tensors found in the files, e.g. 'b.weight'")
def _(tmp: Path) -> Source:
    root = _two_files(tmp, {"a.weight": F1, "c": F2})
    save_file({"a.weight": torch.zeros(4, 2), "b.weight": torch.zeros(1)}, str(root / F1))
    save_file({"c": torch.zeros(1)}, str(root / F2))
    return Source(root)


@case("index-not-json", CheckpointError, "model.safetensors.index.json: not valid JSON")
def _(tmp: Path) -> Source:
    return Source(_two_files(tmp, "{weight_map"))


@case("index-without-weight-map", CheckpointError, "must be an object with a 'weight_map' of tensor name -> file name")
def _(tmp: Path) -> Source:
    return Source(_two_files(tmp, '{"metadata": {}}'))


@case("same-tensor-in-two-files", CheckpointError, f"tensor 'a.weight' is in both {F1} and {F2}")
def _(tmp: Path) -> Source:
    root = _two_files(tmp, None)
    save_file({"a.weight": torch.zeros(1)}, str(root / F2))
    return Source(root)


@case("empty-directory", CheckpointError, "no model.safetensors, model.safetensors.index.json or *.safetensors files")
def _(tmp: Path) -> Source:
    (tmp / "ckpt").mkdir()
    return Source(tmp / "ckpt")


@case("no-such-path", CheckpointError, "no such checkpoint (expected a directory or a .safetensors file)")
def _(tmp: Path) -> Source:
    return Source(tmp / "nowhere")


@case("config-not-json", CheckpointError, "config.json: not valid JSON")
def _(tmp: Path) -> Source:
    root = save_checkpoint(tmp / "ckpt", {"a.weight": torch.zeros(2, 2)})
    (root / "config.json").write_text("{model_type: llama")
    return Source(root)


@case("config-not-object", CheckpointError, "config.json: must be a JSON object, got list")
def _(tmp: Path) -> Source:
    return Source(save_checkpoint(tmp / "ckpt", {"a.weight": torch.zeros(2, 2)}, config=["llama"]))  # type: ignore[arg-type]


# --- manifests and plans -----------------------------------------------------------------------------------

def _with_rules(tmp: Path, rules: str, *, name: str = "rules.yaml", tensors: dict | None = None, **kw) -> Source:
    root = save_checkpoint(tmp / "ckpt", tensors or {
        "model.layers.3.mlp.up_proj.weight": torch.zeros(12, 4),
        "model.layers.3.mlp.down_proj.weight": torch.zeros(4, 12),
        "norm.weight": torch.zeros(4),
    })
    path = tmp / name
    path.write_text(rules)
    return Source(root, path, **kw)


@case("unknown-kind", RegistryError, "unknown kind 'colum'; known kinds: column, ", *(f" {k}" for k in BUILTIN_KINDS))
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: colum}\n")


@case("pad-not-bool", PlanError, "option pad='no' must be true or false")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: column, pad: 'no'}\n")


@case("strict-not-bool", ManifestError, "strict must be true or false, got 'no'")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "strict: 'no'\nrules:\n  - {pattern: '*.up_proj.weight', kind: column}\n")


@case("invalid-regex", ManifestError, "rule '(unclosed.*': invalid regex: missing ), unterminated subpattern")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {regex: '(unclosed.*', kind: column}\n")


@case("packed-blocks-wrong-sum", PlanError, "model.layers.3.mlp.up_proj.weight: packed_column blocks [4, 4] "
      "sum to 8, not dim 0 size 12")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: packed_column, blocks: [4, 4]}\n")


# the tp values that plan this checkpoint are those dividing 12 (up_proj is the only tensor cut); the rule's
# `pad: true` is offered because a rules file is there to edit
@case("dim-not-divisible-column", PlanError, "model.layers.3.mlp.up_proj.weight: dim 0 has size 12, "
      "not divisible by tp=5; set `pad: true` on the rule in the rules file ",
      "rules.yaml or pick a tp that plans this checkpoint: 1, 2, 3, 4, 6, 12 (rule '*.up_proj.weight', kind column)")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: column}\n", tp=5)


@case("dim-not-divisible-row", PlanError, "model.layers.3.mlp.down_proj.weight: dim 1 has size 12, "
      "not divisible by tp=8", "(rule '*.down_proj.weight', kind row)")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.down_proj.weight', kind: row}\n", tp=8)


@case("kv-heads-vs-tp-from-config", PlanError, "model.layers.0.self_attn.k_proj.weight: dim 0: 3 heads cannot "
      "be shared by tp=2 (neither divides the other)")
def _(tmp: Path) -> Source:
    config = llama_config(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=6,
                          num_key_value_heads=3, vocab_size=32)
    return Source(make_checkpoint(tmp / "ckpt", config))


@case("strict-flag-rule-matches-nothing", PlanError, "rule 'nothing.*' (column) matches no tensor; "
      "1 such rules under --strict")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: 'nothing.*', kind: column}\n", strict=True)


@case("strict-manifest-unmatched-tensor", PlanError, "1 tensors match no rule and the manifest is strict, "
      "e.g. 'norm.weight'")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "strict: true\nrules:\n  - {pattern: '*_proj.weight', kind: replicate}\n")


@case("default-strict-unmatched-tensor", PlanError, "3 tensors match no rule and the manifest is strict")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, '{"default": "strict", "rules": [{"pattern": "x", "kind": "row"}]}', name="r.json")


@case("rank-not-below-tp", PlanError, "rank=2 is out of range for tp=2 (0..1)")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: []\n", ranks="0,2")


@case("tp-zero", PlanError, "tp=0 must be an integer from 1 to 4096")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: []\n", tp=0)


@case("tp-negative", PlanError, "tp=-3 must be an integer from 1 to 4096")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: []\n", tp=-3)


@case("tp-absurd", PlanError, "tp=5000 must be an integer from 1 to 4096")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: []\n", tp=5000)


@case("ranks-not-integers", PlanError, "--ranks '0,x': expected comma-separated integers like 0,2")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: []\n", ranks="0,x")


@case("rules-not-yaml", ManifestError, "rules.yaml: not valid YAML")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: [\n  - {pattern: 'a'")


@case("rules-not-json", ManifestError, "r.json: not valid JSON")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, '{"rules": [}', name="r.json")


@case("rules-file-missing", ManifestError, "cannot read rules file")
def _(tmp: Path) -> Source:
    src = _with_rules(tmp, "rules: []\n")
    src.rules.unlink()
    return src


@case("rules-not-a-manifest", ManifestError, "a manifest is an object with a `rules` list")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "just a string\n")


@case("rules-unknown-top-level-key", ManifestError, "unknown top-level keys ['rule']; expected rules, strict")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules: []\nrule: {pattern: a, kind: row}\n")


@case("rule-pattern-and-regex", ManifestError, "rule 0 needs `kind` and exactly one of `pattern`, `regex`")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: a, regex: a, kind: row}\n")


@case("rule-pattern-not-string", ManifestError, "rule 0: pattern and kind must be strings")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: [a], kind: row}\n")


@case("rules-bad-default", ManifestError, "default must be 'replicate' or 'strict', got 'shard'")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "default: shard\nrules: []\n")


@case("option-heads-zero", PlanError, "rule '*.up_proj.weight': option heads=0 must be a positive integer")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: column, heads: 0}\n")


@case("packed-without-blocks", PlanError, "packed_column needs `blocks`, a list of positive block sizes")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: packed_column}\n")


@case("packed-heads-length", PlanError, "packed_column: 2 heads entries for 3 blocks")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: '*.up_proj.weight', kind: packed_column, "
                            "blocks: [4, 4, 4], heads: [1, 1]}\n")


@case("row-on-1d-tensor", PlanError, "norm.weight: shape [4] has no dim 1 to split")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: 'norm.weight', kind: row}\n")


@case("column-on-scalar", PlanError, "step: shape [] has no dim 0 to split")
def _(tmp: Path) -> Source:
    return _with_rules(tmp, "rules:\n  - {pattern: step, kind: column}\n", tensors={"step": torch.tensor(3)})


def _config_source(tmp: Path, **config) -> Source:
    return Source(save_checkpoint(tmp / "ckpt", {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(12, 4),
                                                 "model.layers.0.mlp.gate_up_proj.weight": torch.zeros(8, 4)},
                                  config=config))


@case("config-unknown-model-type", ManifestError, "config.json: model_type 'mystery' has no TP plan anywhere",
      "write a rules file: put reshard-rules.yaml in the checkpoint directory or pass --rules FILE")
def _(tmp: Path) -> Source:
    return _config_source(tmp, model_type="mystery")


@case("config-unknown-tp-style", ManifestError, "model_type 'llama': TP plan entry 'layers.*.mlp.up_proj' uses "
      "style 'colwise_magic', which reshard cannot honour; write a rules file")
def _(tmp: Path) -> Source:
    return _config_source(tmp, model_type="llama", base_model_tp_plan={"layers.*.mlp.up_proj": "colwise_magic"})


@case("config-tp-style-not-string", ManifestError, "uses style ['colwise'], which reshard cannot honour")
def _(tmp: Path) -> Source:
    return _config_source(tmp, model_type="llama", base_model_tp_plan={"layers.*.mlp.up_proj": ["colwise"]})


@case("config-zero-heads", ManifestError, "config.json `num_attention_heads` = 0 (int) must be a positive integer: "
      "reshard splits attention projections on head boundaries with it")
def _(tmp: Path) -> Source:
    return _config_source(tmp, model_type="phi3", num_attention_heads=0, hidden_size=4, intermediate_size=4)


@case("config-heads-missing", ManifestError, "config.json `hidden_size` = 4 is not a multiple of num_attention_heads "
      "= 32, and config.json has no head_dim: the head size is unknown; set head_dim in config.json")
def _(tmp: Path) -> Source:
    return _config_source(tmp, model_type="phi3", hidden_size=4, intermediate_size=4)


@case("config-null-intermediate-size", ManifestError, "'layers.*.mlp.gate_up_proj' is packed_column but its block "
      "sizes are unknown (intermediate_size=None); write a rules file")
def _(tmp: Path) -> Source:
    return _config_source(tmp, model_type="phi3", num_attention_heads=2, num_key_value_heads=1, hidden_size=4,
                          intermediate_size=None)


@case("no-rules-no-config", ManifestError, "no --rules given, no reshard-rules.yaml and no config.json")
def _(tmp: Path) -> Source:
    return Source(save_checkpoint(tmp / "ckpt", {"a.weight": torch.zeros(2)}))


# --- running the cases ---------------------------------------------------------------------------------------

@pytest.mark.pure
def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 30


@pytest.mark.pure
@pytest.mark.parametrize("build, cls, needles", CASES)
def test_library_raises_exact_error(tmp_path: Path, build: Callable[[Path], Source], cls: type, needles: tuple) -> None:
    src = build(tmp_path)
    with pytest.raises(ReshardError) as e:
        ckpt, manifest = open_source(src.path, rules=src.rules)
        ranks = parse_ranks(src.ranks) if src.ranks else None
        make_plan(ckpt, manifest, src.tp, ranks=ranks, strict=src.strict)
    assert type(e.value) is cls, (type(e.value), str(e.value))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    assert "\n" not in str(e.value)


WRITE_ONLY = {"rank-not-below-tp", "ranks-not-integers"}  # `reshard plan` has no --ranks
CLI_CASES = [pytest.param("write", *c.values, id=f"write-{c.id}") for c in CASES] + [
    pytest.param("plan", *c.values, id=f"plan-{c.id}") for c in CASES if c.id not in WRITE_ONLY
]


@pytest.mark.pure
@pytest.mark.parametrize("command, build, cls, needles", CLI_CASES)
def test_cli_fails_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], build: Callable[[Path], Source], cls: type,
    needles: tuple, command: str,
) -> None:
    src = build(tmp_path)
    argv = [command, src.path, f"--tp={src.tp}"]
    argv += ["--rules", src.rules] if src.rules else []
    argv += ["--strict"] if src.strict else []
    out = tmp_path / "out"
    if command == "write":
        argv += ["-o", out] + (["--ranks", src.ranks] if src.ranks else [])
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 1
    assert_one_error_line(rc, err, *needles)
    assert stdout == ""
    assert not out.exists()


@pytest.mark.multiproc
def test_real_process_prints_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, not just `main()`: one line on stderr, exit 1, no output directory."""
    ckpt = write_file(tmp_path / "ckpt" / "model.safetensors", raw_safetensors(F32_22, b"\0" * 10)).parent
    proc = subprocess.run([sys.executable, "-m", "reshard.cli", "write", str(ckpt), "--tp", "2", "-o",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1
    assert_one_error_line(proc.returncode, proc.stderr, "truncated download?")
    assert proc.stdout == "" and not (tmp_path / "out").exists()


# --- warnings, direct API checks --------------------------------------------------------------------------

@pytest.mark.pure
def test_rule_matching_nothing_is_a_warning_without_strict(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    src = _with_rules(tmp_path, "rules:\n  - {pattern: 'nothing.*', kind: column}\n"
                                "  - {pattern: '*.up_proj.weight', kind: column}\n")
    ckpt, manifest = open_source(src.path, rules=src.rules)
    assert make_plan(ckpt, manifest, 2).warnings == ("rule 'nothing.*' (column) matches no tensor",)
    rc, out, err = run_cli(["write", src.path, "--tp", 2, "--rules", src.rules, "-o", tmp_path / "out"], capsys)
    assert rc == 0
    assert err == "reshard: warning: rule 'nothing.*' (column) matches no tensor\n"
    assert "wrote 2 rank files" in out and (tmp_path / "out" / "reshard.json").is_file()
    rc, _, err = run_cli(["plan", src.path, "--tp", 2, "--rules", src.rules, "--strict"], capsys)
    assert rc == 1 and "matches no tensor" in err


@pytest.mark.pure
@pytest.mark.parametrize(
    "tp, rank, message",
    [
        (0, None, "tp=0 must be an integer from 1 to 4096"),
        (-1, None, "tp=-1 must be an integer from 1 to 4096"),
        (5000, None, "tp=5000 must be an integer from 1 to 4096"),
        (4097, None, "tp=4097 must be an integer from 1 to 4096"),
        (2.0, None, "tp=2.0 must be an integer from 1 to 4096"),
        (True, None, "tp=True must be an integer from 1 to 4096"),
        ("2", None, "tp='2' must be an integer from 1 to 4096"),
        (4, 4, "rank=4 is out of range for tp=4 (0..3)"),
        (4, -1, "rank=-1 is out of range for tp=4 (0..3)"),
        (1, 1, "rank=1 is out of range for tp=1 (0..0)"),
    ],
    ids=["tp0", "tp-1", "tp5000", "tp4097", "tp-float", "tp-bool", "tp-str", "rank=tp", "rank-neg", "tp1-rank1"],
)
def test_check_tp(tp: object, rank: object, message: str) -> None:
    with pytest.raises(PlanError) as e:
        check_tp(tp, rank)
    assert str(e.value) == message
    check_tp(4096, 4095)  # the limits themselves are fine


@pytest.mark.pure
def test_make_plan_rejects_bad_tp_and_rank(tmp_path: Path) -> None:
    ckpt = Checkpoint.open(save_checkpoint(tmp_path / "c", {"a": torch.zeros(4)}))
    manifest = Manifest.from_dict({"rules": []})
    for tp, ranks, msg in [(0, None, "tp=0 "), (5000, None, "tp=5000 "), (2, [2], "rank=2 "), (2, [-1], "rank=-1 ")]:
        with pytest.raises(PlanError, match=msg):
            make_plan(ckpt, manifest, tp, ranks=ranks)
    assert [r.rank for r in make_plan(ckpt, manifest, 4096, ranks=[4095]).ranks] == [4095]


@pytest.mark.pure
def test_parse_header_truncated_blob() -> None:
    """A header blob shorter than its declared length (the file itself is long enough)."""
    blob = valid_file_bytes()
    with pytest.raises(HeaderError) as e:
        parse_header(blob[:20], path="x.safetensors", file_size=len(blob))
    (n,) = struct.unpack("<Q", blob[:8])
    assert str(e.value) == f"x.safetensors: header truncated: 12 of {n} bytes"


@pytest.mark.pure
def test_valid_edge_cases_are_accepted(tmp_path: Path) -> None:
    """Not everything odd is an error: zero tensors, zero-size tensors, null metadata, padding spaces."""
    cases = {
        "no-tensors": raw_safetensors({}),
        "zero-size": raw_safetensors({"a": entry("F32", [0, 3], 0), "b": entry("U8", [2], 0)}, b"\0\0"),
        "null-metadata": raw_safetensors({"__metadata__": None} | F32_22, b"\0" * 16),
        "space-padded": raw_safetensors(json.dumps(F32_22).encode() + b"     ", b"\0" * 16),
    }
    for name, blob in cases.items():
        info, tensors = read_header(write_file(tmp_path / f"{name}.safetensors", blob))
        assert info.size == len(blob) and info.metadata == {}
        for t in tensors.values():
            assert t.start >= info.header_len
