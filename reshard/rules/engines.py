"""Engine cuts: a manifest rewritten so each rank's shard is cut the way an inference engine holds it.

transformers' TP plans (and so reshard's default manifests) say how transformers splits a model. An
engine may hold some tensors differently; an engine cut is one registered function `Manifest -> Manifest`
that adjusts the rules for it, chosen by name: `reshard write --engine vllm`, `reshard plan --engine
vllm`, the service's `?engine=vllm`, `ShardClient(..., engine="vllm")`. (It is not a `reshard.layout.Layout`:
that says how many ranks split what; this says how an engine cuts each tensor within tensor parallelism.) The adjusted options are part
of the manifest, so they change the plan's digest (the service's ETags) and each rank file's
self-description records them (a vocabulary cut for vLLM says `align: 64`).

`vllm`: vLLM's `VocabParallelEmbedding` / `ParallelLMHead` pad the vocabulary to a multiple of 64 and
split the padded size evenly by tp (rank r holds rows [r*chunk, (r+1)*chunk), zeros past the real
vocabulary), where transformers splits ceil(vocab / tp) rows; vocab 1000 at tp=2 is 512 + 488 (+24 zero
rows) in vLLM and 500 + 500 in transformers. vLLM also splits shared experts (Qwen2-MoE's
`shared_expert`, DeepSeek-style `shared_experts`) like any MLP, where transformers' plans replicate them,
and gpt-oss' MXFP4 experts by TP (`reshard.rules.quant.VLLM_RULES`), where transformers' plan leaves
them to expert parallelism. transformers' gpt-oss plan replicates attention; vLLM splits it by heads
(`QKVParallelLinear`, a `RowParallelLinear` o_proj whose bias every rank holds, each rank its heads' `sinks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reshard.errors import RegistryError
from reshard.registry import registrar
from reshard.rules.manifest import Manifest, Rule
from reshard.rules.quant import VLLM_RULES
from reshard.rules.quant.fp8_kinds import base_kind

Cut = Callable[[Manifest, Sequence[str], Mapping[str, Any]], Manifest]
_ENGINES: dict[str, Cut] = {}

# vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm.model_executor.layers.vocab_parallel_embedding)
VLLM_VOCAB_ALIGN = 64
VOCAB_KINDS = frozenset({"vocab_embed"})


def register_engine(name: str) -> Callable[[Cut], Cut]:
    """Bind `name` to a function `(manifest, tensor names, config.json) -> manifest`; registering a name twice
    is an error."""
    return registrar(_ENGINES, (name,), lambda n: f"engine {n!r}", known="known engines")


def known_engines() -> list[str]:
    return sorted(_ENGINES)


def apply_engine(manifest: Manifest, engine: str | None, names: Sequence[str] = (),
                 config: Mapping[str, Any] | None = None) -> Manifest:
    """`manifest` adjusted for `engine` (None: unchanged), the checkpoint's tensor `names` and its config.json
    (sizes a cut's rules read; None: unknown); an unknown engine raises and lists the known ones."""
    if engine is None:
        return manifest
    if engine not in _ENGINES:
        raise RegistryError(f"unknown engine {engine!r}; known engines: {', '.join(known_engines())}")
    return _ENGINES[engine](manifest, names, config or {})


def is_vocab_split(kind: str, options: dict[str, Any]) -> bool:
    """A kind that splits a vocabulary: `vocab_embed`, or a padded `column` (an lm_head); quantized or not
    (`column_gptq`, a GPTQ checkpoint's quantized lm_head, is a `column`)."""
    kind = base_kind(kind)
    return kind in VOCAB_KINDS or (kind == "column" and options.get("pad") is True and "heads" not in options)


# shared experts: vLLM builds them as a MergedColumnParallelLinear gate_up_proj and a RowParallelLinear down_proj
_SHARED_EXPERTS = (
    Rule(r".*\.shared_experts?\.(gate|up)_proj\.weight", "column", {}, regex=True),
    Rule(r".*\.shared_experts?\.down_proj\.weight", "row", {}, regex=True),
)



def _gpt_oss_attention(config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """gpt-oss' attention (recognized by its sinks): vLLM's GptOssAttention splits q, the sinks and o by
    heads, and k/v by kv heads, each kv head on several ranks where tp exceeds them (`QKVParallelLinear`)."""
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    q = {"heads": heads} if isinstance(heads, int) else {}
    kv_opts = {"heads": kv, "replicate_heads": True} if isinstance(kv, int) else {}
    return (Rule(r".*\.self_attn\.q_proj\.(weight|bias)", "column", q, regex=True),
            Rule(r".*\.self_attn\.(k|v)_proj\.(weight|bias)", "column", kv_opts, regex=True),
            Rule(r".*\.self_attn\.o_proj\.weight", "row", {}, regex=True),
            Rule(r".*\.self_attn\.sinks", "column", q, regex=True))


@register_engine("vllm")
def _vllm(manifest: Manifest, names: Sequence[str], config: Mapping[str, Any]) -> Manifest:
    rules = [dataclasses.replace(r, options={**r.options, "align": VLLM_VOCAB_ALIGN}) if is_vocab_split(r.kind, r.options) else r
             for r in manifest.rules]
    shared = [r for r in _SHARED_EXPERTS if any(r.matches(n) for n in names)]  # (a rule matching nothing warns)
    packed = [r for r in VLLM_RULES if any(r.matches(n) for n in names)]  # before the rest: they replace its twins
    if any(n.endswith(".self_attn.sinks") for n in names):
        packed += list(_gpt_oss_attention(config))
    rules = [r for r in rules if not _shadowed(r, packed)]
    return Manifest((*packed, *rules, *shared), manifest.strict, f"{manifest.source}, cut for vllm")


def _shadowed(rule: Rule, first: Sequence[Rule]) -> bool:
    """A quantized twin (`reshard.rules.quant.rules.FollowRule`) whose every weight a rule of `first` takes."""
    weights = getattr(rule, "weights", None)
    return bool(weights) and all(any(r.matches(w) for r in first) for w in weights)
