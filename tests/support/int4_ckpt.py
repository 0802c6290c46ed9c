"""Int4 checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized W4A16) quantized from random weights, and
the reference dequantizers the tests check shards with; both written from each format's description, not
from reshard's code.

The three formats store the same thing (4-bit integers per group of `g` input columns, a scale per group and
output, maybe a zero point) in three layouts. A linear weight is `W [N, K]` (out, in):

| format | tensors of module X | 4-bit values | dequantized |
|---|---|---|---|
| GPTQ (`quant_method: gptq`) | `qweight` I32 `[K/8, N]` packed along K; `qzeros` I32 `[G, N/8]` along N, stored as zero - 1; `scales` F16 `[G, N]`; `g_idx` I32 `[K]` (the group of each input) | unsigned 0..15 | `(q - (z + 1)) * s` of group `g_idx[k]` |
| AWQ (`quant_method: awq`, GEMM) | `qweight` I32 `[K, N/8]` packed along N; `qzeros` `[G, N/8]`; `scales` F16 `[G, N]` | unsigned, each int32's 8 nibbles are columns 0,2,4,6,1,3,5,7 | `(q - z) * s` of group `k // g` |
| compressed-tensors `pack-quantized` | `weight_packed` I32 `[N, K/8]` packed along K; `weight_scale` `[N, G]`; `weight_zero_point` I32 `[N/8, G]` along N (asymmetric only); `weight_shape` I64 `[2]` = `[N, K]`; `weight_g_idx` I32 `[K]` (actorder `group`) | signed -8..7, stored + 8 | `(q - zp) * s` of group `g_idx[k]` (else `k // g`) |

Packing: along the packed dim, each run of 8 values goes into one int32, value j of the run in bits
4j..4j+3 (AWQ: the value of column `AWQ_ORDER[j]`). `G` = K / g groups; channelwise (`group_size: -1`,
compressed-tensors strategy `channel`) is one group of all K. Act order (GPTQ `desc_act`, compressed-tensors
`actorder: group`) numbers groups in a permuted order of the inputs, so `g_idx` is not `k // g`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from reshard.testing.synth import make_checkpoint
from tests.support.tp_math import linear_index

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR = re.compile(r"(.*\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj)\.weight")
FORMATS = ("gptq", "awq", "ct")
# the tensors of a quantized module, by format (besides a bias)
TENSORS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
           "ct": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")}


def pack(values: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned 4-bit `values` (0..15) packed 8 per int32 along `dim` (see the module docstring)."""
    v = values.to(torch.int64).movedim(dim, -1)
    *lead, n = v.shape
    assert n % 8 == 0, f"{n} values along dim {dim} are not whole int32s"
    v = v.reshape(*lead, n // 8, 8)
    if order is not None:
        v = v[..., list(order)]
    packed = (v << (4 * torch.arange(8))).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def unpack(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The 4-bit values (int64, 0..15) of `packed` along `dim`: `pack`'s inverse."""
    p = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    *lead, n = p.shape
    nibbles = (p.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
    if order is not None:
        out = torch.empty_like(nibbles)
        out[..., list(order)] = nibbles
        nibbles = out
    return nibbles.reshape(*lead, n * 8).movedim(-1, dim)


def group_index(k: int, group: int, *, act_order: bool = False, gen: torch.Generator | None = None) -> torch.Tensor:
    """The group of each of `k` inputs (`group` -1: one group); with act order, groups follow a random
    permutation of the inputs, as GPTQ's desc_act numbers them by decreasing activation."""
    g = k if group == -1 else group
    if not act_order:
        return torch.arange(k) // g
    perm = torch.randperm(k, generator=gen)
    out = torch.empty(k, dtype=torch.long)
    out[perm] = torch.arange(k) // g
    return out


def quantize_groups(w: torch.Tensor, gidx: torch.Tensor, *, sym: bool, scale_dtype: torch.dtype,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] unsigned 0..15, scale [N, G] in `scale_dtype`, zero [N, G] 0..15) of `w` [N, K] per group of
    `gidx`: symmetric (zero 8, scale amax / 7) or asymmetric (scale (max - min) / 15, zero >= `min_zero`)."""
    n, groups = w.shape[0], int(gidx.max()) + 1
    w = w.float()
    scale, zero = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, gidx == g]
        if sym:
            scale[:, g] = cols.abs().amax(1).clamp(min=1e-8) / 7
            zero[:, g] = 8
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, g] = ((hi - lo) / 15).clamp(min=1e-8)
            zero[:, g] = (-lo / scale[:, g]).round().clamp(min_zero, 15).long()
    scale = scale.to(scale_dtype)
    s, z = scale.float()[:, gidx], zero[:, gidx]
    q = ((w / s).round() + z).clamp(0, 15).long()
    return q, scale, zero


def quantize(fmt: str, w: torch.Tensor, *, group: int, sym: bool = True, act_order: bool = False,
             dtype: torch.dtype = torch.bfloat16, gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear weight `w` [N, K] in format `fmt`, by their suffix."""
    n, k = w.shape
    gidx = group_index(k, group, act_order=act_order, gen=gen)
    if fmt == "gptq":  # zeros are stored minus one (AutoGPTQ's layout): keep them >= 1
        q, scale, zero = quantize_groups(w, gidx, sym=sym, scale_dtype=torch.float16, min_zero=1)
        return {"qweight": pack(q.T, 0), "qzeros": pack((zero - 1).T, 1), "scales": scale.T.contiguous(),
                "g_idx": gidx.to(torch.int32)}
    if fmt == "awq":
        assert not act_order, "AWQ has no act order"
        q, scale, zero = quantize_groups(w, gidx, sym=False, scale_dtype=torch.float16)
        return {"qweight": pack(q.T, 1, AWQ_ORDER), "qzeros": pack(zero.T, 1, AWQ_ORDER), "scales": scale.T.contiguous()}
    assert fmt == "ct", fmt
    q, scale, zero = quantize_groups(w, gidx, sym=sym, scale_dtype=dtype)
    out = {"weight_packed": pack(q, 1), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if not sym:
        out["weight_zero_point"] = pack(zero, 0)
    if act_order:
        out["weight_g_idx"] = gidx.to(torch.int32)
    return out


def dequantize(fmt: str, t: dict[str, torch.Tensor], *, groups: torch.Tensor) -> torch.Tensor:
    """`W [n, k]` (float32) from a module's tensors `t` (by suffix; a rank's pieces or the whole), where
    `groups[i]` is the row of `t`'s scales (and zeros) that input column i of `t`'s weight uses."""
    if fmt == "gptq":
        q, z = unpack(t["qweight"], 0), unpack(t["qzeros"], 1) + 1
        s = t["scales"].float()
        return ((q - z[groups]) * s[groups]).T
    if fmt == "awq":
        q, z = unpack(t["qweight"], 1, AWQ_ORDER), unpack(t["qzeros"], 1, AWQ_ORDER)
        return ((q - z[groups]) * t["scales"].float()[groups]).T
    q, s = unpack(t["weight_packed"], 1) - 8, t["weight_scale"].float()
    zp = unpack(t["weight_zero_point"], 0) - 8 if "weight_zero_point" in t else torch.zeros_like(s)
    return (q - zp[:, groups]) * s[:, groups]


def full_groups(fmt: str, t: dict[str, torch.Tensor], k: int, group: int) -> torch.Tensor:
    """The group of each of the `k` inputs of a whole module: its `g_idx` when stored, else `k // group`."""
    gidx = t.get("g_idx", t.get("weight_g_idx"))
    return gidx.long() if gidx is not None else group_index(k, group)


def gptq_qc(group: int = 32, *, desc_act: bool = False, sym: bool = True) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
            "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq"}


def awq_qc(group: int = 32) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def ct_qc(group: int | None = 32, *, sym: bool = True, actorder: str | None = None) -> dict[str, Any]:
    """llm-compressor's W4A16 (`group_size` None: channelwise) as compressed-tensors writes it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "actorder": actorder,
               "strategy": "channel" if group is None else "group", "group_size": group, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
                "format": "pack-quantized"}}}


def format_of(qc: dict[str, Any]) -> tuple[str, int, bool, bool]:
    """(format, group size (-1: channelwise), symmetric, act order) of a quantization_config of the above."""
    if qc["quant_method"] == "gptq":
        return "gptq", qc["group_size"], qc["sym"], qc["desc_act"]
    if qc["quant_method"] == "awq":
        return "awq", qc["group_size"], False, False
    w = qc["config_groups"]["group_0"]["weights"]
    return "ct", -1 if w["strategy"] == "channel" else w["group_size"], w["symmetric"], w["actorder"] == "group"


def int4_checkpoint(path: Path, config: dict[str, Any], qc: dict[str, Any], *, seed: int = 0,
                    keep: tuple[str, ...] = (), dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random checkpoint for `config` (reshard.testing.synth) with its linear weights quantized as `qc`
    says, but for the weights in `keep` (left in `dtype`, as `ignore` / `modules_to_not_convert` leave them)."""
    make_checkpoint(path, config, dtype=dtype, seed=seed, std=0.05)
    return quantize_checkpoint(path, qc, seed=seed, keep=keep)


def quantize_checkpoint(path: Path, qc: dict[str, Any], *, seed: int = 0, keep: tuple[str, ...] = (),
                        dtype: torch.dtype = torch.bfloat16) -> Path:
    """The checkpoint at `path` (one model.safetensors) quantized in place as `qc` says (see int4_checkpoint)."""
    fmt, group, sym, act_order = format_of(qc)
    state = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        m = LINEAR.fullmatch(name)
        if m is None or name in keep:
            out[name] = w
            continue
        for suffix, t in quantize(fmt, w, group=group, sym=sym, act_order=act_order, dtype=dtype, gen=gen).items():
            out[f"{m.group(1)}.{suffix}"] = t
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def modules(state: dict[str, torch.Tensor], fmt: str) -> dict[str, dict[str, torch.Tensor]]:
    """The quantized modules of a state dict: module name -> its tensors by suffix."""
    first = TENSORS[fmt][0]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in state:
        if name.endswith("." + first):
            stem = name[: -len(first) - 1]
            out[stem] = {s: state[f"{stem}.{s}"] for s in TENSORS[fmt] if f"{stem}.{s}" in state}
    return out


def in_features(fmt: str, t: dict[str, torch.Tensor]) -> int:
    """K of a module's (or a rank's piece of a module's) packed weight."""
    return {"gptq": lambda: t["qweight"].shape[0] * 8, "awq": lambda: t["qweight"].shape[0],
            "ct": lambda: t["weight_packed"].shape[1] * 8}[fmt]()


def dequantized_weights(path: Path, qc: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every quantized module's weight `W [N, K]` (float32) of the full checkpoint, by `X.weight` name."""
    fmt, group, _sym, _act = format_of(qc)
    out = {}
    for stem, t in modules(load_file(path / "model.safetensors"), fmt).items():
        k = in_features(fmt, t)
        out[stem + ".weight"] = dequantize(fmt, t, groups=full_groups(fmt, t, k, group))
    return out


# --- what a rank holds, by the TP math (independent of reshard's plan: tests/support/tp_math.py) ------------

def logical_index(stem: str, cfg: dict[str, Any], tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of N, columns of K) of module `stem`'s weight that rank `rank` of `tp` holds (a whole dim of a
    llama linear is always the hidden size: the outputs of o/down, the inputs of the others)."""
    rows, cols = linear_index(stem.rsplit(".", 1)[-1], cfg, tp, rank)
    every = torch.arange(cfg["hidden_size"])
    return (every if rows is None else rows), (every if cols is None else cols)


def stored_index(fmt: str, suffix: str, rows: torch.Tensor, cols: torch.Tensor, groups: torch.Tensor,
                 shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Per stored dim of part `suffix`, the indices a rank holding logical `rows` x `cols` holds, where
    `groups` are the scale groups it holds."""
    def by8(t: torch.Tensor) -> torch.Tensor:
        return torch.unique(t // 8)

    return {
        "gptq": {"qweight": [by8(cols), rows], "qzeros": [groups, by8(rows)], "scales": [groups, rows],
                 "g_idx": [cols]},
        "awq": {"qweight": [cols, by8(rows)], "qzeros": [groups, by8(rows)], "scales": [groups, rows]},
        "ct": {"weight_packed": [rows, by8(cols)], "weight_scale": [rows, groups], "weight_zero_point": [by8(rows), groups],
               "weight_g_idx": [cols], "weight_shape": [torch.arange(shape[0])]},
    }[fmt][suffix]


def rank_groups(qc: dict[str, Any], cols: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The scale groups (rows of `scales`) a rank holding input columns `cols` holds: its own groups, or
    all of them where every rank keeps every group (channelwise, act order)."""
    _fmt, group, _sym, act_order = format_of(qc)
    if group == -1 or act_order:
        return torch.arange(n_groups)
    return torch.unique(cols // group)


def local_groups(fmt: str, qc: dict[str, Any], t: dict[str, torch.Tensor], cols: torch.Tensor,
                 held: torch.Tensor) -> torch.Tensor:
    """For each input column of a rank's tensors `t`, the row of its scales (holding groups `held`) to use:
    the rank's own `g_idx` when stored, else the column's group by `k // g`."""
    _fmt, group, _sym, _act = format_of(qc)
    gidx = t.get("g_idx", t.get("weight_g_idx"))
    g = gidx.long() if gidx is not None else (torch.zeros_like(cols) if group == -1 else cols // group)
    lut = torch.full((int(held.max()) + 1,), -1, dtype=torch.long)
    lut[held] = torch.arange(len(held))
    assert (lut[g] >= 0).all(), "a column's group is not among the scales the rank holds"
    return lut[g]
