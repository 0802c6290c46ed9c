"""A kind registered from anywhere (here: this test file) drives plan, write and load like a built-in.

The test kind gives rank r the chunk tp-1-r of dim 0 (reversed rank order). It is registered inside a
fixture and removed from `reshard.rules.kinds._REGISTRY` afterwards, so other tests never see it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.errors import RegistryError
from reshard.format.checkpoint import Checkpoint
from reshard.format.rank_file import rank_file_name
from reshard.format.selection import Selection
from reshard.io.sinks.write import write_shards
from reshard.plan.planner import make_plan
from reshard.rules import kinds as loaders
from reshard.rules.kinds import SliceLoader, known_kinds, loader_for, register_loader, split_interval
from reshard.rules.manifest import Manifest, Rule
from tests.support.core import assert_same, random_tensor, run_cli, save_checkpoint

pytestmark = pytest.mark.pure

KIND = "test_rows_reversed"
BUILTIN_KINDS = ["column", "packed_column", "replicate", "row", "vocab_embed"]


class ReversedRows(SliceLoader):
    """Rank r of tp gets the (tp-1-r)-th contiguous chunk of dim 0."""

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        iv = split_interval(shape[0], world_size - 1 - rank, world_size, what="dim 0")
        return ((iv,), *(((0, n),) for n in shape[1:]))


@pytest.fixture
def reversed_kind() -> Iterator[str]:
    @register_loader(KIND)
    def _factory(rule: Rule, suffix: str) -> ReversedRows:
        return ReversedRows()

    try:
        yield KIND
    finally:
        loaders._REGISTRY.pop(KIND, None)


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(21)
    tensors = {"w.weight": random_tensor((8, 3), torch.bfloat16, gen),
               "v.weight": random_tensor((4, 2, 2), torch.int64, gen),
               "n.weight": random_tensor((3,), torch.float32, gen)}
    return save_checkpoint(tmp_path / "ckpt", tensors), tensors


@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda tp: f"tp{tp}")
def test_registered_kind_writes_reversed_chunks(tmp_path: Path, reversed_kind: str, tp: int) -> None:
    assert reversed_kind in known_kinds()
    root, tensors = _checkpoint(tmp_path)
    manifest = Manifest.from_dict({"rules": [{"regex": r"[wv]\.weight", "kind": reversed_kind}]})
    ckpt = Checkpoint.open(root)
    write_shards(ckpt, make_plan(ckpt, manifest, tp), tmp_path / "out", progress=False)
    for rank in range(tp):
        path = tmp_path / "out" / rank_file_name(rank, tp)
        got = load_file(str(path))
        for name in ("w.weight", "v.weight"):
            assert_same(got[name], torch.chunk(tensors[name], tp, 0)[tp - 1 - rank], f"{name} rank {rank}")
        assert_same(got["n.weight"], tensors["n.weight"])
        with safe_open(str(path), "pt") as f:
            described = json.loads(f.metadata()["tensors"])
        assert described["w.weight"]["kind"] == reversed_kind
        with safe_open(str(root / "model.safetensors"), "pt") as f:
            loaded = loader_for(manifest.rules[0], ".weight").load(f.get_slice("w.weight"), rank, tp)
        assert_same(loaded, torch.chunk(tensors["w.weight"], tp, 0)[tp - 1 - rank])


def test_registered_kind_through_cli_rules_file(tmp_path: Path, reversed_kind: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root, tensors = _checkpoint(tmp_path)
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"rules:\n  - pattern: w.weight\n    kind: {reversed_kind}\n")
    rc, _, err = run_cli(["write", root, "--tp", 2, "--rules", rules, "-o", tmp_path / "out"], capsys)
    assert (rc, err) == (0, "")
    got = load_file(str(tmp_path / "out" / rank_file_name(0, 2)))
    assert_same(got["w.weight"], tensors["w.weight"][4:])


def test_registering_a_kind_twice_lists_known_kinds(reversed_kind: str) -> None:
    with pytest.raises(RegistryError) as e:
        register_loader(reversed_kind)(lambda rule, suffix: ReversedRows())
    assert str(e.value) == f"kind '{reversed_kind}' is already registered; known kinds: " + ", ".join(known_kinds())
    assert {*BUILTIN_KINDS, reversed_kind} <= set(known_kinds())


def test_redefining_a_builtin_kind_fails_and_keeps_the_original() -> None:
    before = loaders._REGISTRY["column"]
    with pytest.raises(RegistryError, match="kind 'column' is already registered; known kinds: column, "):
        register_loader("column")(lambda rule, suffix: ReversedRows())
    assert loaders._REGISTRY["column"] is before


def test_unknown_kind_in_a_rule_lists_known_kinds() -> None:
    with pytest.raises(RegistryError) as e:
        Manifest.from_dict({"rules": [{"pattern": "*", "kind": KIND}]})
    assert str(e.value) == f"unknown kind '{KIND}'; known kinds: " + ", ".join(known_kinds())
    assert set(BUILTIN_KINDS) <= set(known_kinds()) and KIND not in known_kinds()
    with pytest.raises(RegistryError, match=f"unknown kind '{KIND}'"):
        Rule("*", KIND)
