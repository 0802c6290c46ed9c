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

Without a rules file, `reshard.rules.from_config` derives a manifest from config.json: its `base_model_tp_plan` when
present, else the plan transformers declares for its `model_type` (installed, or the table shipped in
`reshard.rules.tp_plans`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import ManifestError
from reshard.rules.kinds import check_kind
from reshard.rules.patterns import FirstMatch, PatternError, compile_glob, compile_regex

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
        try:  # RE2 (reshard.rules.patterns): matching time is linear in the name's length, whatever the pattern
            compiled = compile_regex(self.pattern) if self.regex else compile_glob(self.pattern)
        except PatternError as e:
            raise ManifestError(f"rule {self.pattern!r}: {e}") from None
        object.__setattr__(self, "_compiled", compiled)

    def matches(self, name: str) -> bool:
        return self._compiled.fullmatch(name)  # type: ignore[attr-defined]

    def __getstate__(self) -> dict[str, Any]:  # the RE2 object does not pickle: compiled again on load
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self.__post_init__()

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

    def match_all(self, names: Iterable[str]) -> list[Rule | None]:
        """`[self.match(n) for n in names]`, all rules at once: plain names by dict lookup, the other
        patterns through one RE2 `Set` (every pattern a name matches, in one pass; the first wins).
        A rule that matches by more than its pattern (a subclass's `matches`) is asked itself, for the
        names no rule before it matches."""
        names = names if isinstance(names, list) else list(names)
        if not self.rules:
            return [None] * len(names)
        plain, custom, combined = self._combined
        rules = self.rules
        found = combined.indices(names)
        if not custom:
            return [None if j < 0 else rules[plain[j]] for j in found]
        out: list[Rule | None] = []
        for name, j in zip(names, found):
            best = plain[j] if j >= 0 else len(rules)
            for i in custom:
                if i >= best:
                    break
                if rules[i].matches(name):
                    best = i
                    break
            out.append(rules[best] if best < len(rules) else None)
        return out

    @functools.cached_property
    def _combined(self) -> tuple[list[int], list[int], FirstMatch]:
        """The rules that match by their pattern alone and those that do not (indices into `rules`),
        and the `FirstMatch` of the former."""
        plain = [i for i, r in enumerate(self.rules) if type(r).matches is Rule.matches]
        custom = [i for i, r in enumerate(self.rules) if type(r).matches is not Rule.matches]
        return plain, custom, FirstMatch([self.rules[i]._compiled for i in plain])  # type: ignore[attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_combined"}

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
        if path.suffix == ".json":  # (yaml is imported only for YAML: a JSON rules file opens without it)
            errors: tuple[type[Exception], ...] = (ValueError,)
            parse: Callable[[str], Any] = json.loads
        else:
            import yaml

            errors, parse = (ValueError, yaml.YAMLError), yaml.safe_load
        try:
            obj = parse(text)
        except errors as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ManifestError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {first}") from None
        return cls.from_dict(obj, source=f"rules file {path}")


# --- config.json -> rules ------------------------------------------------------------------------
# The TP plan of the architecture (reshard.rules.tp_plans: config.json, installed transformers, shipped table)
# gives the rules; then every registered config hook may add rules derived from config.json (e.g. for
# quantization scale tensors). This is the one place extra config-derived rules are appended.

ConfigRuleHook = Callable[[dict[str, Any], list[str]], list[Rule]]
CONFIG_RULE_HOOKS: list[ConfigRuleHook] = []


def register_config_rules(hook: ConfigRuleHook) -> ConfigRuleHook:
    """Add `hook(config, tensor_names) -> rules`; its rules come before the plan's (first match wins)."""
    if hook in CONFIG_RULE_HOOKS:
        raise ManifestError(f"config rule hook {hook!r} is already registered")
    CONFIG_RULE_HOOKS.append(hook)
    return hook
