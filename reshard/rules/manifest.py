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

import fnmatch
import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from reshard.errors import ManifestError
from reshard.rules.kinds import check_kind

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

    def match_all(self, names: Iterable[str]) -> list[Rule | None]:
        """`[self.match(n) for n in names]`, with one regex for all the rules where they combine: an
        alternation of the rules' patterns, each in a group, matches the whole name with the first
        rule that does (the regex engine tries the alternatives in order), and says which."""
        combined = self._combined
        if combined is None:
            return [self.match(n) for n in names]
        rules, found = (None, *self.rules), list(map(combined.fullmatch, names))
        if None not in found:  # every name matched some rule: the rest in C as well
            return list(map(rules.__getitem__, map(attrgetter("lastindex"), found)))  # type: ignore[arg-type]
        return [None if m is None else rules[m.lastindex] for m in found]  # type: ignore[index]

    @functools.cached_property
    def _combined(self) -> re.Pattern[str] | None:
        """`(rule 1)|(rule 2)|...`, or None where a rule matches by more than its pattern (a subclass's
        `matches`) or its own groups (or flags) would not survive the alternation."""
        if not self.rules or any(type(r).matches is not Rule.matches for r in self.rules):
            return None
        patterns = [r._re for r in self.rules]  # type: ignore[attr-defined]
        if any(p.groups or p.flags & ~re.UNICODE for p in patterns):
            return None
        try:
            return re.compile("|".join(f"({p.pattern})" for p in patterns))
        except re.error:  # e.g. a global flag such as (?i) that must start the pattern
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
