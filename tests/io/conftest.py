"""Fixtures of the io tests: a real moto S3 server and a static Range file server on 127.0.0.1
(`reshard.testing.local_servers`, both counting the body bytes they serve), a small checkpoint on local
disk and the same files in the bucket and under the file server's root. The output-fault fixtures (`ckpt`,
`reference`, `mounts`, `fs`) are the root conftest's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from reshard.testing.local_servers import StoreServer, http_server, s3_server
from tests.support.live import make_ckpt

BUCKET = "ckpts"


@pytest.fixture(scope="session")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/llama: llama-like, 2 files + index.json, vocab 250 (padded at tp=4), float32."""
    root = tmp_path_factory.mktemp("stores") / "root"
    make_ckpt(root / "llama", vocab_size=250, num_key_value_heads=4, num_files=2)
    return root


@pytest.fixture(scope="session")
def s3(local_root: Path) -> Iterator[StoreServer]:
    with s3_server() as srv:
        client = boto3.client("s3", endpoint_url=srv.url, **_keys(srv.env))
        client.create_bucket(Bucket=BUCKET)
        for p in sorted((local_root / "llama").iterdir()):
            client.upload_file(str(p), BUCKET, f"models/llama/{p.name}")
        yield srv


@pytest.fixture(scope="session")
def web(local_root: Path) -> Iterator[StoreServer]:
    with http_server(local_root) as srv:
        yield srv


def _keys(env: dict[str, str]) -> dict[str, str]:
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region_name": env["AWS_REGION"]}


@pytest.fixture
def s3_env(s3: StoreServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The test process pointed at the moto server (AWS_* variables)."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RESHARD_STORE_RETRIES", "1")
    return s3.env


@pytest.fixture
def boto(s3: StoreServer) -> Any:
    return boto3.client("s3", endpoint_url=s3.url, **_keys(s3.env))


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
