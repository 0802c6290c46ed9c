"""Rules for a quantized checkpoint, derived from config.json's `quantization_config` and tensor names.

`quantized_rules(rules, config, names)` is the hook the manifest calls: for a quantized checkpoint
every rule that matches a quantized weight (an `X.weight` with an `X.weight_scale_inv` or
`X.weight_scale` beside it) gets a quantized twin, placed before it, that matches exactly those
weights and their companions (`X.weight_scale_inv`, `X.weight_scale`, `X.input_scale`): so a scale is
planned by its weight's rule, with its weight's kind, whatever the rule's pattern says about scales.
Unquantized tensors (norms, embeddings, `modules_to_not_convert`, `ignore`) keep the original rule;
quantized weights no rule matches get `replicate_fp8` (full weight, full scale).

A rules file can say the same explicitly: a kind `column_fp8` (etc.) with `block: [128, 128]` on a
pattern that matches the weight and its scales (`model.layers.*.self_attn.q_proj.*`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from reshard.rules.manifest import Rule
from reshard.rules.quant.fp8_kinds import quantized_kind
from reshard.rules.quant.scheme import FP8, QuantScheme, Scheme, scheme_from_config, scheme_of_kind


@dataclass(frozen=True)
class FollowRule(Rule):
    """A rule's quantized twin: matches the quantized weights `weights` the rule matches, and their companions."""

    weights: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        super().__post_init__()
        # the companions' weight as its kind's scheme names them, looked up once (matches runs per tensor name)
        scheme = scheme_of_kind(self.kind) or FP8
        object.__setattr__(self, "_weight_of", scheme.weight_of)
        object.__setattr__(self, "_logical", scheme.logical_name)

    def matches(self, name: str) -> bool:
        weight = name if name in self.weights else self._weight_of(name)  # type: ignore[attr-defined]
        return weight is not None and weight in self.weights and rule_matches_weight(self, weight, self._logical)  # type: ignore[attr-defined]


def rule_matches_weight(rule: Rule, weight: str, logical: Callable[[str], str | None]) -> bool:
    """Whether `rule` (its pattern alone) matches a quantized weight: by its own name or its module's
    logical weight's (`X.weight` for `X.qweight`: what rules derived from a TP plan name)."""
    if Rule.matches(rule, weight):
        return True
    other = logical(weight)
    return other is not None and other != weight and Rule.matches(rule, other)


def quantized_weights(names: Iterable[str], packed: QuantScheme = FP8) -> frozenset[str]:
    """The `X.weight` names that have a scale tensor of `packed` beside them."""
    names = set(names)
    return frozenset(
        n[: -len(suffix)] + packed.weight_suffix for n in names for suffix in packed.scale_suffixes
        if n.endswith(suffix) and n[: -len(suffix)] + packed.weight_suffix in names
    )


def twin(rule: Rule, scheme: Scheme, weights: frozenset[str]) -> FollowRule:
    """The quantized twin of `rule`: its kind's variant in the scheme's packed format (`column_fp8`), its
    options plus the scheme's `block`."""
    return FollowRule(rule.pattern, quantized_kind(rule.kind, scheme.packed), {**rule.options, **scheme.options()},
                      rule.regex, weights)


def quantized_rules(rules: list[Rule], config: dict[str, Any] | None, names: Iterable[str]) -> list[Rule]:
    """`rules` for the checkpoint `config` describes: unchanged unless it is quantized (see the module)."""
    scheme = scheme_from_config(config)
    names = list(names)
    weights = quantized_weights(names, scheme.packed) if scheme else frozenset()
    if not weights:
        return rules
    assert scheme is not None  # (weights is empty without one)
    first: dict[int, set[str]] = {}  # rule index -> the quantized weights it is the first match of
    rest = set()
    for w in weights:
        i = next((i for i, rule in enumerate(rules) if rule_matches_weight(rule, w, scheme.packed.logical_name)), None)
        (rest if i is None else first.setdefault(i, set())).add(w)
    plain = [n for n in names if n not in weights and scheme.packed.weight_of(n) not in weights]
    out: list[Rule] = []
    for i, rule in enumerate(rules):
        mine = frozenset(first.get(i, ()))
        explicit = scheme_of_kind(rule.kind) is not None
        if mine and not explicit:
            out.append(twin(rule, scheme, mine))
        if explicit or not mine or any(rule.matches(n) for n in plain):  # the rule still serves others (biases)
            out.append(rule)
    if rest:
        out.append(twin(Rule("*", "replicate"), scheme, frozenset(rest)))
    return out


def logical_names(config: dict[str, Any] | None, names: Iterable[str]) -> list[str]:
    """The logical weights of the quantized modules among `names` that are not tensors themselves
    (`X.weight` for GPTQ's `X.qweight`, `X` for MXFP4's `X_blocks`): rules derived from a TP plan are
    derived for them too, so a module's twin is found by the name the plan knows."""
    scheme = scheme_from_config(config)
    if scheme is None:
        return []
    names = list(names)
    have = set(names)
    out = {scheme.packed.logical_name(w) for w in quantized_weights(names, scheme.packed)}
    return sorted(n for n in out if n is not None and n not in have)
