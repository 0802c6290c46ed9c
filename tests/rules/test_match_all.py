"""`Manifest.match_all` (one alternation regex for all the rules) matches each name with the rule that
`Manifest.match` (each rule in turn) picks, for globs, regexes and rules whose own groups, flags or
`matches` keep them out of the alternation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import ManifestError
from reshard.plan.planner import resolve_rules
from reshard.rules.manifest import Manifest, Rule
from reshard.rules.quant.rules import FollowRule

pytestmark = pytest.mark.pure

PARTS = ["a", "b", ".", "*", "?", "[ab]", "[!a]", "1"]
REGEXES = [r"a.*", r"(a|b)+\.1", r"(?i)A.*", r"[ab]{2,}", r"a|b", r".*\.b", r"b$"]
NAMES = st.text(st.sampled_from("ab.1A"), max_size=6)
GLOBS = st.lists(st.sampled_from(PARTS), min_size=1, max_size=4).map("".join)
RULES = st.lists(st.one_of(GLOBS.map(lambda p: Rule(p, "column")),
                           st.sampled_from(REGEXES).map(lambda p: Rule(p, "row", regex=True))), max_size=5)


@settings(max_examples=300, deadline=None, database=None)
@given(RULES, st.lists(NAMES, max_size=30), st.booleans())
def test_match_all_picks_the_rule_match_picks(rules: list[Rule], names: list[str], follow: bool) -> None:
    if follow and rules:  # a rule that matches by more than its pattern: match_all falls back to it
        rules = [FollowRule(rules[0].pattern, "column_fp8", {}, rules[0].regex, frozenset(names[:2])), *rules[1:]]
    manifest = Manifest(tuple(rules))
    got = manifest.match_all(names)
    assert len(got) == len(names)
    assert all(a is b for a, b in zip(got, [manifest.match(n) for n in names], strict=True))


def test_plain_rules_use_one_regex() -> None:
    """The alternation is what runs for ordinary rules (globs, regexes without groups)."""
    manifest = Manifest((Rule("*.gate_proj.weight", "column"), Rule(r"model\.layers\.\d+\..*", "row", regex=True),
                         Rule("*.weight", "replicate")))
    assert manifest._combined is not None
    names = ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.down_proj.weight", "lm_head.weight", "x"]
    assert manifest.match_all(names) == [manifest.rules[0], manifest.rules[1], manifest.rules[2], None]
    with pytest.raises(ManifestError, match="backreference"):  # RE2 has none: refused
        Rule(r"(a)\1", "row", regex=True)
    chosen, unused = resolve_rules(names, manifest)
    assert [chosen[n].kind for n in names] == ["column", "row", "replicate", "replicate"] and unused == []
