"""The generated tables of docs/*.md are what scripts/gen_docs.py makes now, and the hand-written
tables name everything the code registers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import gen_docs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.pure  # in-process: settings classes, parsers and results files only


@pytest.mark.parametrize("page", gen_docs.pages(), ids=lambda p: p.name)
def test_generated_tables_are_current(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert text == gen_docs.generated(text, where=str(page)), (
        f"{page.relative_to(ROOT)}: a generated table differs from what the code and the results say; "
        "run `.venv/bin/python scripts/gen_docs.py` and commit the result")


def test_every_generator_has_its_table() -> None:
    used = {m["name"] for p in gen_docs.pages() for m in gen_docs.BLOCK.finditer(p.read_text(encoding="utf-8"))}
    assert used == set(gen_docs.GENERATORS), f"generators without a table: {sorted(set(gen_docs.GENERATORS) - used)}"


def _first_column(page: str, header: str) -> set[str]:
    """The backquoted names in the first column of the table whose header row starts with `header`."""
    lines = (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {header} |"))
    names: set[str] = set()
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        names |= set(re.findall(r"`([a-z0-9_]+)`", ln.split("|")[1]))
    return names


def test_the_kinds_table_names_every_plain_kind() -> None:
    import reshard  # noqa: F401  (registers every shipped kind)
    from reshard.rules.kinds import known_kinds
    from reshard.rules.quant.scheme import scheme_of_kind

    plain = {k for k in known_kinds() if scheme_of_kind(k) is None}  # a quantized twin is its scheme's
    assert plain == _first_column("manifest.md", "kind")


def test_the_styles_table_names_every_transformers_style() -> None:
    from reshard.rules.tp_plans.styles import KNOWN_STYLES

    assert set(KNOWN_STYLES) == _first_column("transformers.md", "transformers style")
