"""`reshard merge` checks the rank files against the digests recorded beside them (`reshard.json` of a
write, a training checkpoint's `trainer_state.json`): a rank file of another write put in their place,
or damaged, is one line and nothing merged. The reference: the rank files the writes produced.

With no digests to catch it, it refuses pieces that do not make one checkpoint
(`reshard.io.sinks.merge_checks`): files that record different plan identities, ranks that all understate a tensor's shape (config.json's model says
otherwise), a tensor the layout puts on every rank that some ranks lack, replicated copies that differ, a
piece described at another place than its rule gives its rank; one line naming the tensor and the ranks.
The rank files are real writes edited on disk with safetensors; the reference for the shapes is
transformers' own model of config.json."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from reshard.cli import main as reshard
from reshard.errors import IntegrityError
from reshard.format.rank_file import rank_file_name
from reshard.io.hashing import file_sha256
from reshard.io.sinks.hf_checkpoint import check_recorded
from reshard.io.source.opener import open_shards
from reshard.testing.synth import make_checkpoint, preset_config

pytestmark = pytest.mark.pure
NORM, UP, K = "model.norm.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight"


def _run(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = reshard(list(args))
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def two_writes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("merge_integrity")
    for name, seed in (("a", 1), ("b", 2)):
        make_checkpoint(root / f"{name}-full", preset_config("tiny"), seed=seed)
        assert _run("write", str(root / f"{name}-full"), "--tp", "2", "-o", str(root / name), "--no-progress")[0] == 0
    return root


def test_a_rank_file_of_another_write_is_refused(two_writes: Path, tmp_path: Path) -> None:
    mixed = shutil.copytree(two_writes / "a", tmp_path / "mixed")
    shutil.copy(two_writes / "b" / rank_file_name(1, 2), mixed / rank_file_name(1, 2))  # a's reshard.json stays
    rc, err = _run("merge", str(mixed), "-o", str(tmp_path / "out"))
    assert rc == 1 and err.count("\n") == 1, err
    assert f"{mixed / rank_file_name(1, 2)}: sha256" in err and "does not match the recorded" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert _run("merge", str(two_writes / "a"), "-o", str(tmp_path / "ok"))[0] == 0  # the write as it was merges


def test_a_rank_file_the_record_does_not_list_is_refused(two_writes: Path, tmp_path: Path) -> None:
    mixed = shutil.copytree(two_writes / "a", tmp_path / "mixed")
    record = json.loads((mixed / "reshard.json").read_text())
    del record["files"][rank_file_name(0, 2)]
    (mixed / "reshard.json").write_text(json.dumps(record))
    with pytest.raises(IntegrityError, match="not among the rank files reshard.json records beside it"):
        check_recorded(open_shards(mixed))


def test_a_training_checkpoints_optimizer_files_are_checked_against_its_state(two_writes: Path, tmp_path: Path) -> None:
    """`optimizer/` rank files are checked against `trainer_state.json`'s `optimizer/...` digests."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_writes / "a", ckpt / "optimizer")
    (ckpt / "optimizer" / "reshard.json").unlink()
    files = {f"optimizer/{rank_file_name(r, 2)}": file_sha256(ckpt / "optimizer" / rank_file_name(r, 2)) for r in range(2)}
    (ckpt / "trainer_state.json").write_text(json.dumps({"files": files}))
    check_recorded(open_shards(ckpt / "optimizer"))  # as saved
    shutil.copy(two_writes / "b" / rank_file_name(0, 2), ckpt / "optimizer" / rank_file_name(0, 2))
    with pytest.raises(IntegrityError, match=f"{rank_file_name(0, 2)}: sha256 .* does not match the recorded"):
        check_recorded(open_shards(ckpt / "optimizer"))


@pytest.fixture(scope="module")
def writes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("merge_checks")
    make_checkpoint(root / "full", preset_config("tiny"), seed=3)  # 4 heads, 2 kv heads
    for tp in (2, 4):
        assert _run("write", str(root / "full"), "--tp", str(tp), "-o", str(root / f"tp{tp}"), "--no-progress")[0] == 0
    return root


def _copy(src: Path, dst: Path) -> Path:
    """The rank files and config.json alone: no digests recorded beside them to catch an edit."""
    shutil.copytree(src, dst)
    (dst / "reshard.json").unlink()
    return dst


def _edit(path: Path, change: Callable[[dict[str, torch.Tensor], dict[str, Any]], None]) -> None:
    """Rewrite one rank file: `change(tensors, descriptions)` in place, the DCP offsets following."""
    with safe_open(path, "pt") as f:
        meta = dict(f.metadata())
    tensors, desc = load_file(path), json.loads(meta["tensors"])
    change(tensors, desc)
    dcp = {k: v for k, v in json.loads(meta["DCP_SHARDING_INFO"]).items() if k in tensors}
    save_file(tensors, path, {**meta, "tensors": json.dumps(desc, sort_keys=True), "DCP_SHARDING_INFO": json.dumps(dcp)})


def _refused(src: Path, out: Path) -> str:
    rc, err = _run("merge", str(src), "-o", str(out), "--no-progress")
    assert rc == 1 and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    return err


def test_a_rank_file_of_another_plan_is_refused_by_its_plan_identity(writes: Path, tmp_path: Path) -> None:
    """Rank 1 of a write of another model (its vocabulary 64 rows larger) beside rank 0, with no digests
    recorded: the files record different plan identities, and merge says so naming both, before it
    reads a tensor."""
    make_checkpoint(tmp_path / "other-full", {**preset_config("tiny"), "vocab_size": preset_config("tiny")["vocab_size"] + 64})
    assert _run("write", str(tmp_path / "other-full"), "--tp", "2", "-o", str(tmp_path / "other"), "--no-progress")[0] == 0
    plans = {}
    for d in (writes / "tp2", tmp_path / "other"):
        with safe_open(d / rank_file_name(1, 2), "pt") as f:
            plans[d.name] = f.metadata()["plan"]
    assert plans["tp2"] != plans["other"]
    src = _copy(writes / "tp2", tmp_path / "src")
    shutil.copy(tmp_path / "other" / rank_file_name(1, 2), src / rank_file_name(1, 2))
    err = _refused(src, tmp_path / "out")
    assert f"{src / rank_file_name(1, 2)}: written by the plan {plans['other']}, rank 0's file by the plan " \
           f"{plans['tp2']}; the rank files are of different writes" in err, err


def test_ranks_that_all_understate_a_shape_are_refused_by_the_models_shape(writes: Path, tmp_path: Path) -> None:
    """up_proj cut to 96 of its 128 rows in the checkpoint, then written at tp=2: both ranks agree on
    [96, 64], so only config.json's model can tell."""
    want = tuple(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(writes / "full")).state_dict()[UP].shape)
    assert want == (128, 64)
    full = shutil.copytree(writes / "full", tmp_path / "full")
    tensors = load_file(full / "model.safetensors")
    tensors[UP] = tensors[UP][:96].clone()
    save_file(tensors, full / "model.safetensors", {"format": "pt"})
    assert _run("write", str(full), "--tp", "2", "-o", str(tmp_path / "cut"), "--no-progress")[0] == 0
    err = _refused(tmp_path / "cut", tmp_path / "out")  # reshard.json beside it: every digest as written
    assert f"tensor {UP!r} has global shape [96, 64]" in err and "config.json (llama) implies [128, 64]" in err, err
    assert _run("merge", str(writes / "tp2"), "-o", str(tmp_path / "ok"), "--no-progress")[0] == 0


def test_a_tensor_one_rank_lacks_is_refused_naming_the_ranks(writes: Path, tmp_path: Path) -> None:
    src = _copy(writes / "tp4", tmp_path / "src")
    for r in (1, 3):
        _edit(src / rank_file_name(r, 4), lambda t, d: (t.pop(NORM), d.pop(NORM)))
    err = _refused(src, tmp_path / "out")
    assert f"tensor {NORM!r}: the tp=4 layout puts it on ranks [0, 1, 2, 3], but ranks [1, 3] lack it" in err, err


@pytest.mark.parametrize(("tp", "name", "rank", "same"), [(2, NORM, 1, [0]), (4, K, 3, [2])])
def test_replicated_copies_that_differ_are_refused(writes: Path, tmp_path: Path, tp: int, name: str, rank: int,
                                                   same: list[int]) -> None:
    """A replicated norm at tp=2; at tp=4 with 2 kv heads, ranks 2 and 3 share kv head 1 of k_proj."""
    with safe_open(writes / f"tp{tp}" / rank_file_name(rank, tp), "pt") as f:
        select = json.loads(f.metadata()["tensors"])[name]["select"]
    if name == K:
        assert select == [[[16, 32]], [[0, 64]]]  # head_dim 16: kv head 1, the same piece as rank 2's
    src = _copy(writes / f"tp{tp}", tmp_path / "src")
    _edit(src / rank_file_name(rank, tp), lambda t, d: t[name].add_(1))
    err = _refused(src, tmp_path / "out")
    assert f"tensor {name!r}: its replicated copies differ: ranks {same} hold one, ranks [{rank}] another" in err, err


def test_a_piece_described_at_another_place_is_refused(writes: Path, tmp_path: Path) -> None:
    """Ranks 0 and 1 swap their up_proj descriptions (and bytes): the pieces still tile the tensor, but
    the plan of a column rule puts rows 0-63 on rank 0."""
    src = _copy(writes / "tp2", tmp_path / "src")
    held = {r: (load_file(src / rank_file_name(r, 2))[UP], json.loads(safe_open(src / rank_file_name(r, 2), "pt")
                                                                       .metadata()["tensors"])[UP]) for r in (0, 1)}

    def swap(r: int) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
        return lambda t, d: (t.__setitem__(UP, held[1 - r][0]), d.__setitem__(UP, held[1 - r][1]))

    for r in (0, 1):
        _edit(src / rank_file_name(r, 2), swap(r))
    err = _refused(src, tmp_path / "out")
    assert f"{rank_file_name(0, 2)}: tensor {UP!r} is described as column of global shape [128, 64], selecting " \
           "[[[64, 128]], [[0, 64]]]; the tp=2 plan gives rank 0 column of global shape [128, 64], selecting " \
           "[[[0, 64]], [[0, 64]]]" in err, err
