"""A rank file of an int4 checkpoint checked against the full checkpoint from what it records alone (for
layouts whose TP math a test does not spell out: experts across ranks, fused n-D experts).

For each quantized module in the rank file: every part's recorded selection names the checkpoint's own
bytes (the rank's tensor equals the checkpoint's at those indices); the parts agree on the logical rows (N)
and inputs (K) the rank holds: the weight's selection, in its units, gives them, and every other part holds
exactly the packed int32s, groups and indices those need (all groups where scales are whole along K); and
the rank's tensors dequantize (tests/support/int4_ckpt.py) to exactly those rows and inputs of the full
dequantized weight. Leading dims (experts of a fused `[E, ...]` tensor) are taken as the weight takes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.int4_ckpt import TENSORS, dequantize, format_of, local_groups
from tests.support.rank_files import rank_file, same_bytes

# per format and part, the logical axis of each trailing stored dim and its unit: N (outputs), K (inputs),
# G (groups of K), S (a dim no split touches)
STORED: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {
    "gptq": {"qweight": (("K", 8), ("N", 1)), "qzeros": (("G", 1), ("N", 8)), "scales": (("G", 1), ("N", 1)),
             "g_idx": (("K", 1),)},
    "awq": {"qweight": (("K", 1), ("N", 8)), "qzeros": (("G", 1), ("N", 8)), "scales": (("G", 1), ("N", 1))},
    "ct": {"weight_packed": (("N", 1), ("K", 8)), "weight_scale": (("N", 1), ("G", 1)),
           "weight_zero_point": (("N", 8), ("G", 1)), "weight_g_idx": (("K", 1),), "weight_shape": (("S", 1),)},
}


def indices(intervals: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in intervals]) if intervals else torch.zeros(0, dtype=torch.long)


def check_rank_file(path: Path, full: dict[str, torch.Tensor], deq: dict[str, torch.Tensor],
                    qc: dict[str, Any]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Check one rank file (see the module); returns per quantized module stem the leading (expert) indices,
    rows and inputs the rank holds."""
    fmt, group, _sym, act_order = format_of(qc)
    local, desc = rank_file(path)
    for name, t in local.items():  # every tensor: the checkpoint's bytes at its recorded selection
        want = full[name]
        for d, ivs in enumerate(desc[name]["select"]):
            want = want.index_select(d, indices(ivs))
        assert same_bytes(t, want), (path.name, name)
    weight = TENSORS[fmt][0]
    out = {}
    for wname in [n for n in local if n.endswith("." + weight)]:
        stem = wname[: -len(weight) - 1]
        sel = desc[wname]["select"]
        lead = len(sel) - 2
        axes = dict(zip((a for a, _ in STORED[fmt][weight]), sel[lead:]))
        units = dict(STORED[fmt][weight])
        n_idx = indices(axes["N"]) if units["N"] == 1 else _expand(axes["N"], units["N"])
        k_idx = indices(axes["K"]) if units["K"] == 1 else _expand(axes["K"], units["K"])
        n_groups = full[f"{stem}.{'weight_scale' if fmt == 'ct' else 'scales'}"].shape[-1 if fmt == "ct" else -2]
        whole_k = group == -1 or act_order
        held = torch.arange(n_groups) if whole_k else torch.unique(k_idx // group)
        mine = {}
        for suffix in TENSORS[fmt]:
            name = f"{stem}.{suffix}"
            if name not in local:
                assert name not in full, name
                continue
            mine[suffix] = local[name]
            s = desc[name]["select"]
            assert s[:len(s) - len(STORED[fmt][suffix])] == sel[:lead] or suffix == "weight_shape", name
            for (axis, unit), ivs in zip(STORED[fmt][suffix], s[len(s) - len(STORED[fmt][suffix]):]):
                want = {"N": torch.unique(n_idx // unit), "K": torch.unique(k_idx // unit), "G": held,
                        "S": indices(ivs)}[axis]
                assert torch.equal(indices(ivs), want), (path.name, name, axis)
        lead_idx = tuple(indices(ivs) for ivs in sel[:lead])
        got = _dequantize_lead(fmt, qc, mine, k_idx, held, lead)
        want_w = deq[stem + ".weight"]
        for d, idx in enumerate(lead_idx):
            want_w = want_w.index_select(d, idx)
        assert torch.equal(got, want_w.index_select(lead, n_idx).index_select(lead + 1, k_idx)), (path.name, stem)
        out[stem] = (*lead_idx, n_idx, k_idx)
    return out


def _expand(intervals: list[list[int]], unit: int) -> torch.Tensor:
    return indices([[a * unit, b * unit] for a, b in intervals])


def _dequantize_lead(fmt: str, qc: dict[str, Any], t: dict[str, torch.Tensor], k_idx: torch.Tensor,
                     held: torch.Tensor, lead: int) -> torch.Tensor:
    """The rank's tensors of one module dequantized, expert by expert for a fused `[E, ...]` module."""
    if lead:
        per = [{s: v[e] for s, v in t.items() if s != "weight_shape"} for e in range(next(iter(t.values())).shape[0])]
        return torch.stack([_dequantize_lead(fmt, qc, p, k_idx, held, 0) for p in per])
    return dequantize(fmt, t, groups=local_groups(fmt, qc, t, k_idx, held))
