"""`RESHARD_MLA=heads`: DeepSeek-V3's MLA split by heads (beyond transformers' plan, which replicates it).

Checked two ways: every rank's tensors against torch's head-boundary slicing, and the attention math:
transformers' own `DeepseekV3Attention` run once per rank with that rank's shards sums to the full
module's output.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard import cli
from reshard.format.rank_file import rank_file_name
from tests.support.plan_archs import Built, full_checkpoint, same_tensor

pytestmark = pytest.mark.multiproc

HEAD_SPLIT = ("q_b_proj", "kv_b_proj")


def _heads_chunk(t: torch.Tensor, heads: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's whole heads of a head-major projection `[heads * per_head, in]`."""
    return t.reshape(heads, -1, t.shape[-1]).chunk(tp, dim=0)[rank].reshape(-1, t.shape[-1])


@pytest.mark.parametrize("tp", [2, 4])
def test_mla_split_by_heads(zoo: dict[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int) -> None:
    import warnings

    from transformers import AutoModelForCausalLM

    built = zoo["deepseek_v3"]
    built.require("build")
    monkeypatch.setenv("RESHARD_MLA", "heads")
    out = tmp_path / "out"
    assert cli.main(["write", str(built.ckpt), "--tp", str(tp), "-o", str(out), "--no-progress"]) == 0
    full = full_checkpoint(built.ckpt)
    heads = 4
    ranks = [load_file(str(out / rank_file_name(r, tp))) for r in range(tp)]
    for rank, got in enumerate(ranks):
        for layer in range(2):
            pre = f"model.layers.{layer}.self_attn."
            for leaf in HEAD_SPLIT:
                same_tensor(got[pre + leaf + ".weight"], _heads_chunk(full[pre + leaf + ".weight"], heads, rank, tp), leaf)
            same_tensor(got[pre + "o_proj.weight"], torch.chunk(full[pre + "o_proj.weight"], tp, dim=1)[rank], "o_proj")
            for leaf in ("q_a_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"):
                same_tensor(got[pre + leaf + ".weight"], full[pre + leaf + ".weight"], leaf)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(built.ckpt, dtype=torch.float32).eval()
    attn, rotary = model.model.layers[0].self_attn, model.model.rotary_emb
    torch.manual_seed(0)
    x = torch.randn(2, 5, model.config.hidden_size)
    pe = rotary(x, torch.arange(5)[None].expand(2, -1))
    with torch.no_grad():
        want = attn(x, pe, None)[0]
        total = torch.zeros_like(want)
        for got in ranks:
            part = copy.deepcopy(attn)
            for leaf in (*HEAD_SPLIT, "o_proj"):
                getattr(part, leaf).weight = torch.nn.Parameter(got[f"model.layers.0.self_attn.{leaf}.weight"])
            total += part(x, pe, None)[0]
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-6)
