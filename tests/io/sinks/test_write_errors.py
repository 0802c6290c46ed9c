"""Rank files written into S3 (multipart uploads, reshard.json last), an interrupted write, and the one-line
errors for a missing bucket, wrong credentials, an unreachable endpoint and a missing checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard.cli import main
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.plan.planner import make_plan
from reshard.testing.local_servers import TEST_SECRET, s3_server
from reshard.testing.local_servers import s3_env as env_for
from tests.support.live import free_port, make_ckpt

pytestmark = pytest.mark.servers


def _objects(boto, prefix: str) -> dict[str, bytes]:
    listed = boto.list_objects_v2(Bucket="ckpts", Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: boto.get_object(Bucket="ckpts", Key=o["Key"])["Body"].read() for o in listed}


def test_write_to_store_matches_local_and_merges_back(s3_env, boto, local_root: Path, tmp_path: Path) -> None:
    src = str(local_root / "llama")
    assert main(["write", src, "--tp", "4", "-o", "s3://ckpts/out/tp4", "--no-progress"]) == 0
    assert main(["write", src, "--tp", "4", "-o", str(tmp_path / "local"), "--no-progress"]) == 0
    got = _objects(boto, "out/tp4/")
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert sorted(got) == names
    for name in names:
        if name != "reshard.json":
            assert got[name] == (tmp_path / "local" / name).read_bytes(), name
    record = json.loads(got["reshard.json"])
    assert record == json.loads((tmp_path / "local" / "reshard.json").read_text())
    # the shards in the store are a source: merged back they are the local merge, byte for byte
    assert main(["merge", "s3://ckpts/out/tp4", "-o", str(tmp_path / "m-remote"), "--no-progress"]) == 0
    assert main(["merge", str(tmp_path / "local"), "-o", str(tmp_path / "m-local"), "--no-progress"]) == 0
    for p in (tmp_path / "m-local").iterdir():
        assert (tmp_path / "m-remote" / p.name).read_bytes() == p.read_bytes(), p.name


def test_interrupted_multipart_write_leaves_no_final_object(s3_env, boto, tmp_path: Path) -> None:
    src = make_ckpt(tmp_path / "mid", hidden_size=512, intermediate_size=1024, vocab_size=2000,
                    num_attention_heads=8, num_key_value_heads=8)  # rank 0 of tp=2: ~14 MB, two parts
    ckpt, manifest = open_source(src)
    plan = make_plan(ckpt, manifest, 2, ranks=[0])
    assert plan.ranks[0].size > 12 << 20
    boto.put_object(Bucket="ckpts", Key="out/cut/reshard.json", Body=b'{"plan": "an older one", "files": {}}')
    seen = 0

    def crash(n: int) -> None:
        nonlocal seen
        seen += n
        if seen > 10 << 20:  # past the first 8 MiB part
            raise RuntimeError("killed mid-upload")

    with pytest.raises(RuntimeError, match="killed mid-upload"):
        write_shards(ckpt, plan, "s3://ckpts/out/cut", on_bytes=crash)
    assert _objects(boto, "out/cut/") == {}  # no rank file, and the stale reshard.json is gone first
    assert boto.list_multipart_uploads(Bucket="ckpts").get("Uploads", []) == []  # aborted


def _cli_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("reshard: error: "), err
    assert TEST_SECRET not in err
    return err


def test_store_errors_are_one_clear_line(s3_env, web, monkeypatch, capsys) -> None:
    err = _cli_error(capsys, "plan", "s3://no-such-bucket/x", "--tp", "2")
    assert "no such bucket 'no-such-bucket'" in err
    err = _cli_error(capsys, "plan", "s3://ckpts/models/nothing-here", "--tp", "2")
    assert "no such checkpoint" in err
    err = _cli_error(capsys, "plan", f"{web.url}/files/nothing-here/", "--tp", "2")
    assert "no such checkpoint" in err and "cannot list files" in err
    for k, v in env_for(f"http://127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(k, v)
    err = _cli_error(capsys, "plan", "s3://ckpts/models/llama", "--tp", "2")
    assert "cannot reach http://127.0.0.1:" in err


def test_wrong_credentials_are_access_denied(monkeypatch, capsys, local_root: Path) -> None:
    with s3_server(authenticate=True) as srv:
        for k, v in srv.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("RESHARD_STORE_RETRIES", "1")
        err = _cli_error(capsys, "plan", "s3://ckpts/models/llama", "--tp", "2")
        assert "access denied" in err and "InvalidAccessKeyId" in err
        err = _cli_error(capsys, "write", str(local_root / "llama"), "--tp", "2", "-o", "s3://ckpts/x", "--no-progress")
        assert "access denied" in err
