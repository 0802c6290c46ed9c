"""`reshard merge` checks the rank files against the digests recorded beside them (`reshard.json` of a
write, a training checkpoint's `trainer_state.json`): a rank file of another write put in their place,
or damaged, is one line and nothing merged. The reference: the rank files the writes produced."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from reshard.cli import main as reshard
from reshard.errors import IntegrityError
from reshard.format.rank_file import rank_file_name
from reshard.io.hashing import file_sha256
from reshard.io.sinks.hf_checkpoint import check_recorded
from reshard.io.source.opener import open_shards
from reshard.testing.synth import make_checkpoint, preset_config

pytestmark = pytest.mark.pure


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
