"""vLLM started with load_format="reshard" equals vLLM's default load of the same checkpoint.

Each case starts one engine whose workers pull their own shard (over HTTP from `reshard serve`, one case
from a server that asks for a bearer token, given as the loader's `token`; or from rank files of `reshard
write --engine vllm`) into a `model=` directory without weights, and generates (greedy tokens, top-5
logprobs at every step). The reference is vLLM's default loader on the full checkpoint: for the dense
models, reloaded in place in the same engine (`reload_weights`; a reload from a checkpoint with other
weights must change the answer, so the reference really is a fresh load); for the MoE models, a second
engine started with the default loader, since vLLM 0.32's in-place reload of fused experts on CPU does not
reproduce its own fresh load (found while writing these tests). Dense, qkv bias, tied embeddings with a
vocabulary 64 x tp does not divide (at tp=2 and tp=1), two MoE architectures, one with a shared expert (at
tp=2: each MoE case costs two engine starts); each source at both tps. Every parameter of every model
equals vLLM's default load exactly at tp=1 (test_models.py), where no engine is needed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.live import LiveServer
from tests.support.vllm_engine import differences, engine, fill_reports, generate, reload_default

pytestmark = pytest.mark.servers

CASES = [("llama", 2, "url"), ("qwen2", 2, "shards"), ("qwen2_moe", 2, "token"), ("mixtral", 2, "shards"),
         ("llama", 1, "shards"), ("qwen2", 1, "url")]
DENSE = {"llama", "qwen2"}  # vLLM's in-place reload restores these exactly
SHARD_GETS = re.compile(r'^reshard_http_requests_total\{method="GET",route="/v1/checkpoints/\{name\}/shards/\{rank\}",'
                        r'status="200"\} (\S+)$', re.M)


def served(srv: LiveServer) -> tuple[float, float]:
    """(shard body bytes the service sent, shard GETs it answered 200), from its /metrics."""
    text = httpx.get(f"{srv.url}/metrics", headers=srv.headers(), timeout=10).text
    nbytes = sum(float(m) for m in re.findall(r"^reshard_shard_bytes_served_total (\S+)$", text, re.M))
    return nbytes, sum(float(m) for m in SHARD_GETS.findall(text))


def shard_sizes(srv: LiveServer, name: str, tp: int) -> list[int]:
    """Each rank's shard size as the service plans it, cut the vLLM way."""
    plan = httpx.get(f"{srv.ckpt_url(name)}/plan", params={"tp": tp, "engine": "vllm", "tensors": "false"},
                     headers=srv.headers(), timeout=30).json()
    return [r["bytes"] for r in plan["ranks"]]


@pytest.mark.parametrize(("name", "tp", "via"), CASES, ids=[f"{n}-tp{t}-{v}" for n, t, v in CASES])
def test_reshard_load_equals_default_load(name: str, tp: int, via: str, vroot: Path, vserver: LiveServer,
                                          vserver_token: LiveServer, meta_dir: Callable[[str], Path],
                                          vwritten: Callable[..., Path]) -> None:
    srv = vserver_token if via == "token" else vserver
    source = {"shards": str(vwritten(name, tp))} if via == "shards" else {"url": srv.ckpt_url(name)}
    if via == "token":
        source["token"] = srv.token  # type: ignore[assignment]
    model_dir = meta_dir(name)
    assert not list(model_dir.glob("*.safetensors"))  # every weight comes from the shard
    before = served(srv)
    with engine(model_dir, tp, load_format="reshard", model_loader_extra_config=source) as llm:
        after = served(srv)
        reports = fill_reports(llm)
        got = generate(llm)
        if name in DENSE:
            reload_default(llm, vroot.parent / "others" / name)
            other = generate(llm)
            reload_default(llm, vroot / name)
            want = generate(llm)
            assert differences(other, want) != []  # the reload replaced the weights: a fresh default load
    if name not in DENSE:
        with engine(vroot / name, tp) as ref:
            want = generate(ref)
    assert differences(got, want) == []
    # each rank read its own shard once, as planned: the plugin's count per rank, the service's in all
    sizes = shard_sizes(srv, name, tp)
    assert reports == {rank: (tp, sizes[rank]) for rank in range(tp)}
    nbytes, gets = after[0] - before[0], after[1] - before[1]
    assert (nbytes, gets) == ((0, 0) if via == "shards" else (sum(sizes), tp))
    total = sum(p.stat().st_size for p in (vroot / name).glob("*.safetensors"))
    assert tp == 1 or max(sizes) < total  # not the checkpoint: the rank's slices
