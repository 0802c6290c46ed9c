"""Rule manifests: ordered tensor-name patterns -> kind (+ options), from YAML/JSON or an HF tp_plan.

File format (YAML or JSON)::

    strict: false            # true: a tensor no rule matches is an error (else it is replicated)
    rules:                   # first match wins
      - pattern: "model.layers.*.self_attn.q_proj.weight"   # glob (fnmatch), or
        kind: column
      - regex: 'model\\.layers\\.\\d+\\.mlp\\.(gate|up)_proj\\.weight'
        kind: column
      - pattern: model.embed_tokens.weight
        kind: vocab_embed
        pad: true            # every key besides pattern/regex/kind is an option of the kind

Without a rules file, `from_config` derives a manifest from config.json: its `base_model_tp_plan` when
present, else a built-in plan for the `model_type`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import ManifestError
from reshard.loaders import check_kind

_RULE_KEYS = {"pattern", "regex", "kind"}


@dataclass(frozen=True)
class Rule:
    """One rule: a tensor-name pattern (glob, or regex when `regex`) -> kind with options."""

    pattern: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    regex: bool = False

    def __post_init__(self) -> None:
        check_kind(self.kind)
        source = self.pattern if self.regex else fnmatch.translate(self.pattern)
        try:
            object.__setattr__(self, "_re", re.compile(source))
        except re.error as e:
            raise ManifestError(f"rule {self.pattern!r}: invalid regex: {e}") from None

    def matches(self, name: str) -> bool:
        return self._re.fullmatch(name) is not None  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        return {("regex" if self.regex else "pattern"): self.pattern, "kind": self.kind, **self.options}


@dataclass(frozen=True)
class Manifest:
    """Ordered rules plus what to do with tensors none matches; `source` says where it came from."""

    rules: tuple[Rule, ...]
    strict: bool = False
    source: str = "rules"

    def match(self, name: str) -> Rule | None:
        for rule in self.rules:
            if rule.matches(name):
                return rule
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"strict": self.strict, "rules": [r.to_dict() for r in self.rules]}

    def digest(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def from_dict(cls, obj: Any, *, source: str = "rules") -> Manifest:
        if isinstance(obj, list):
            obj = {"rules": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("rules"), list):
            raise ManifestError(f"{source}: a manifest is an object with a `rules` list")
        unknown = set(obj) - {"rules", "strict", "default"}
        if unknown:
            raise ManifestError(f"{source}: unknown top-level keys {sorted(unknown)}; expected rules, strict")
        if type(obj.get("strict", False)) is not bool:
            raise ManifestError(f"{source}: strict must be true or false, got {obj['strict']!r}")
        strict = obj.get("strict", False) or obj.get("default") in ("strict", "error")
        if obj.get("default") not in (None, "replicate", "strict", "error"):
            raise ManifestError(f"{source}: default must be 'replicate' or 'strict', got {obj['default']!r}")
        rules = []
        for i, item in enumerate(obj["rules"]):
            if not isinstance(item, dict) or "kind" not in item or len({"pattern", "regex"} & set(item)) != 1:
                raise ManifestError(f"{source}: rule {i} needs `kind` and exactly one of `pattern`, `regex`: {item!r}")
            is_regex = "regex" in item
            pattern = item["regex" if is_regex else "pattern"]
            if not isinstance(pattern, str) or not isinstance(item["kind"], str):
                raise ManifestError(f"{source}: rule {i}: pattern and kind must be strings")
            options = {k: v for k, v in item.items() if k not in _RULE_KEYS}
            rules.append(Rule(pattern, item["kind"], options, regex=is_regex))
        return cls(tuple(rules), bool(strict), source)

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ManifestError(f"{path}: cannot read rules file: {e.strerror}") from None
        import yaml

        try:
            obj = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ManifestError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {first}") from None
        return cls.from_dict(obj, source=f"rules file {path}")


# --- HF tp_plan -> rules -------------------------------------------------------------------------

HF_STYLES: dict[str, str] = {
    "colwise": "column", "colwise_rep": "column", "local_colwise": "column",
    "rowwise": "row", "rowwise_rep": "row", "local_rowwise": "row",
    "packed_colwise": "packed_column", "local_packed_colwise": "packed_column",
    "embedding_rowwise": "vocab_embed", "vocab_embed": "vocab_embed",
    "replicate": "replicate", "local": "replicate", "gather": "replicate", "sequence_parallel": "replicate",
}

_LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
_PHI3_PLAN = {
    "layers.*.self_attn.qkv_proj": "packed_colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up_proj": "packed_colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
BUILTIN_PLANS: dict[str, dict[str, str]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"), _LLAMA_PLAN),
    "phi3": _PHI3_PLAN,
}


def _attn_sizes(config: dict[str, Any]) -> tuple[int, int, int]:
    try:
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ManifestError(f"config.json: cannot derive attention sizes ({e}); write a rules file instead") from None
    return heads, kv, head_dim


def _options_for(key: str, kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """Options an HF plan leaves implicit: head counts for q/k/v, block sizes for fused tensors."""
    module = key.rsplit(".", 1)[-1]
    if kind == "column" and module in ("q_proj", "k_proj", "v_proj") and "num_attention_heads" in config:
        heads, kv, _ = _attn_sizes(config)
        return {"heads": heads} if module == "q_proj" else {"heads": kv, "replicate_heads": True}
    if kind == "packed_column":
        if module == "qkv_proj":
            heads, kv, hd = _attn_sizes(config)
            return {"blocks": [heads * hd, kv * hd, kv * hd], "heads": [heads, kv, kv],
                    "replicate_heads": [False, True, True]}
        if module == "gate_up_proj" and isinstance(config.get("intermediate_size"), int):
            inter = config["intermediate_size"]
            return {"blocks": [inter, inter]}
        raise ManifestError(f"config.json tp_plan: {key!r} is {kind} but its block sizes are unknown; write a rules file")
    return {}


def _plan_rules(plan: dict[str, Any], config: dict[str, Any]) -> list[Rule]:
    rules = []
    for key, style in plan.items():
        kind = HF_STYLES.get(style) if isinstance(style, str) else None
        if kind is None:
            raise ManifestError(
                f"config.json tp_plan: {key!r} uses style {style!r}, which reshard does not map; "
                f"known: {', '.join(sorted(HF_STYLES))}"
            )
        key = key.removeprefix("model.")
        body = re.escape(key).replace(r"\*", r"\d+")
        rules.append(Rule(rf"(model\.)?{body}\.(weight|bias)", kind, _options_for(key, kind, config), regex=True))
    return rules


def from_config(config: dict[str, Any], tensor_names: Iterable[str] = ()) -> Manifest:
    """Rules from config.json: `base_model_tp_plan` if present, else the built-in plan for `model_type`.

    Embeddings become `vocab_embed` and an untied `lm_head` `column` (its output gathered in the
    trainer), both padded to a multiple of tp.
    """
    plan = config.get("base_model_tp_plan")
    model_type = config.get("model_type")
    if isinstance(plan, dict) and plan:
        source = "config.json base_model_tp_plan"
    elif model_type in BUILTIN_PLANS:
        plan = BUILTIN_PLANS[model_type]
        source = f"built-in plan for model_type {model_type!r}"
    else:
        raise ManifestError(
            f"config.json has no base_model_tp_plan and model_type {model_type!r} has no built-in plan "
            f"(built in: {', '.join(sorted(BUILTIN_PLANS))}); pass --rules FILE"
        )
    rules = _plan_rules(plan, config)
    names = list(tensor_names)
    defaults = (("model.embed_tokens.weight", "vocab_embed", {"pad": True}),
                ("lm_head.weight", "column", {"pad": True, "gather_output": True}))
    for name, kind, options in defaults:
        if not any(r.matches(name) for r in rules):
            rules.append(Rule(name, kind, options))
    if names:
        rules = [r for r in rules if r.regex or any(r.matches(n) for n in names)]
    from reshard.quant.rules import quantized_rules  # quantized checkpoints: scales follow their weights

    rules = quantized_rules(rules, config, names)
    return Manifest(tuple(rules), False, source)


RULES_FILES = ("reshard-rules.yaml", "reshard-rules.yml", "reshard-rules.json")


def resolve_manifest(
    root: Path, config: dict[str, Any] | None, tensor_names: Iterable[str], rules: str | Path | None = None
) -> Manifest:
    """The manifest for a checkpoint: `rules` if given, else a rules file in its directory, else config.json."""
    if rules is not None:
        return Manifest.load(rules)
    for name in RULES_FILES:
        if (Path(root) / name).is_file():
            return Manifest.load(Path(root) / name)
    if config is None:
        raise ManifestError(f"{root}: no --rules given, no {RULES_FILES[0]} and no config.json to derive a plan from")
    return from_config(config, tensor_names)
