"""What a rank of a llama-family model holds under tensor parallelism, by the TP math alone (not by
reshard's plan): the reference the quantized-checkpoint tests check rank files against."""

from __future__ import annotations

from typing import Any

import torch


def heads_rows(heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    """A column split on heads; with fewer heads than ranks each head goes to tp/heads ranks."""
    if heads % tp == 0:
        return torch.arange(heads * head_dim).chunk(tp)[rank]
    h = rank // (tp // heads)
    return torch.arange(h * head_dim, (h + 1) * head_dim)


def linear_index(module: str, cfg: dict[str, Any], tp: int, rank: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows, cols) of linear `module`'s full weight (`q_proj`, ..., fused `qkv_proj`/`gate_up_proj`) that
    rank `rank` of `tp` holds; None: all of that dim."""
    nh, kv, hd, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    q, k = heads_rows(nh, hd, tp, rank), heads_rows(kv, hd, tp, rank)
    half = torch.arange(inter).chunk(tp)[rank]
    return {
        "q_proj": (q, None), "k_proj": (k, None), "v_proj": (k, None),
        "o_proj": (None, torch.arange(nh * hd).chunk(tp)[rank]),
        "gate_proj": (half, None), "up_proj": (half, None), "down_proj": (None, half),
        "qkv_proj": (torch.cat([q, nh * hd + k, (nh + kv) * hd + k]), None),
        "gate_up_proj": (torch.cat([half, inter + half]), None),
    }[module]


def llama_rules(kind_suffix: str, *, heads: int, kv_heads: int, options: str) -> str:
    """A rules file (YAML) saying explicitly what a llama's config derives, with the quantized kinds
    `column{kind_suffix}` / `row{kind_suffix}` and `options` (YAML lines, e.g. `block: [128, 128]`) on each."""
    opts = "".join(f"    {line}\n" for line in options.splitlines())
    return (
        "rules:\n"
        f'  - pattern: "model.layers.*.self_attn.q_proj.*"\n    kind: column{kind_suffix}\n    heads: {heads}\n{opts}'
        f'  - pattern: "model.layers.*.self_attn.[kv]_proj.*"\n    kind: column{kind_suffix}\n    heads: {kv_heads}\n'
        f"    replicate_heads: true\n{opts}"
        "  - regex: 'model\\.layers\\.\\d+\\.(self_attn\\.o|mlp\\.down)_proj\\..*'\n"
        f"    kind: row{kind_suffix}\n{opts}"
        f'  - pattern: "model.layers.*.mlp.*_proj.*"\n    kind: column{kind_suffix}\n{opts}'
        "  - pattern: model.embed_tokens.weight\n    kind: vocab_embed\n    pad: true\n"
        "  - pattern: lm_head.weight\n    kind: column\n    pad: true\n    gather_output: true\n"
    )

