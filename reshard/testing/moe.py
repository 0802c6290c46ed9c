"""A synthetic MoE-shaped checkpoint with many small tensors, for the planning benchmark and tests.

`moe_checkpoint(path, tensors=100_000)` writes expert weights named like DeepSeek-V3's
(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`) plus a few per-layer norms, spread over
`num_files` safetensors files with an index, a rules file (gate/up column, down row) and a config.json
naming DeepSeek-V3 (its pipeline and expert-parallel plans place the tensors of layouts beyond TP). The bytes
are a deterministic pattern (not random: planning reads headers only; tests that read bytes compare
with `torch` slicing of what is on disk). Writing is done straight with numpy and the header encoder,
so 100,000 tensors take a second or two, not minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reshard.format.checkpoint import INDEX_NAME, encode_header

EXPERTS = 64
RULES = {"rules": [
    {"pattern": "*.experts.*.gate_proj.weight", "kind": "column"},
    {"pattern": "*.experts.*.up_proj.weight", "kind": "column"},
    {"pattern": "*.experts.*.down_proj.weight", "kind": "row"},
]}


def moe_names(tensors: int, *, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of about `tensors` tensors: per layer one norm and EXPERTS x (gate, up, down); the last
    layer has as many whole experts as fit (every expert of a layer has its three tensors)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    layer = 0
    while len(out) < tensors:
        out.append((f"model.layers.{layer}.post_attention_layernorm.weight", (hidden,)))
        for e in range(min(EXPERTS, (tensors - len(out)) // 3)):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            out += [(f"{base}.gate_proj.weight", (inter, hidden)), (f"{base}.up_proj.weight", (inter, hidden)),
                    (f"{base}.down_proj.weight", (hidden, inter))]
        layer += 1
    return out


def moe_checkpoint(path: Path, *, tensors: int = 100_000, num_files: int = 16, hidden: int = 16,
                   inter: int = 32) -> Path:
    """Write the checkpoint at `path` (reused when its stamp matches); return `path`."""
    path = Path(path)
    items = moe_names(tensors, hidden=hidden, inter=inter)
    layers = int(items[-1][0].split(".")[2]) + 1
    # config.json names the architecture whose names these are: the pipeline and expert plans of layouts
    # beyond TP come from it (the TP rules from the rules file, which takes precedence)
    config = {"model_type": "deepseek_v3", "num_hidden_layers": layers, "n_routed_experts": EXPERTS,
              "hidden_size": hidden, "moe_intermediate_size": inter, "tie_word_embeddings": False}
    stamp = {"tensors": tensors, "num_files": num_files, "hidden": hidden, "inter": inter, "dtype": "BF16",
             "config": config, "experts": "whole"}
    stamp_file = path / "bench-moe.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(items) // num_files)
    weight_map: dict[str, str] = {}
    for f in range(num_files):
        part = items[f * per_file : (f + 1) * per_file]
        fname = f"model-{f + 1:05d}-of-{num_files:05d}.safetensors"
        entries, pos = [], 0
        for name, shape in sorted(part):
            n = int(np.prod(shape)) * 2
            entries.append((name, "BF16", shape, pos, pos + n))
            weight_map[name] = fname
            pos += n
        header = encode_header({"format": "pt"}, entries)
        data = (np.arange(pos // 2, dtype=np.uint32) * 2654435761 % 65521).astype(np.uint16)
        with open(path / fname, "wb") as fh:
            fh.write(header)
            fh.write(data.tobytes())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "reshard-rules.json").write_text(json.dumps(RULES))
    (path / "config.json").write_text(json.dumps(config))
    stamp_file.write_text(json.dumps(stamp))
    return path
