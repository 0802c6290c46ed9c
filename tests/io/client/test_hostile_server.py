"""`reshard pull` (shards and `--meta`), `pull_model_dir`, `fill_model` and the trainer's build against a server
that lies (tests/support/hostile.py: a real HTTP server on 127.0.0.1 serving real rank files): names that
point outside the directory, bodies past their listed size, a trickle, a lying Content-Length, a shard whose
header runs past its end, another rank's file, flipped bytes under the true digest, a digest of zeros,
symlinks planted at the pull's temp names, credentials in the URL. Each case fails without its guard: the
bytes would land outside, the pull would never end, or a wrong shard would be published or loaded."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.cli import main
from reshard.errors import IntegrityError, ReshardError
from reshard.format.rank_file import rank_file_name
from reshard.io.client.body import ShardBody
from reshard.io.client.shard_client import ShardClient
from reshard.testing.synth import llama_config, make_checkpoint
from tests.support.hostile import HostileServer, endless

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

CONFIG = b'{"model_type": "llama"}\n'


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny llama checkpoint's rank files at tp=2 and tp=1 (`reshard write`), and its config."""
    base = tmp_path_factory.mktemp("hostile")
    ckpt = make_checkpoint(base / "ckpt", llama_config(), seed=5)
    out: dict[tuple[int, int], bytes] = {}
    for tp in (1, 2):
        assert main(["write", str(ckpt), "--tp", str(tp), "-o", str(base / f"tp{tp}"), "--no-progress"]) == 0
        for r in range(tp):
            out[(r, tp)] = (base / f"tp{tp}" / rank_file_name(r, tp)).read_bytes()
    return {"files": out, "config": json.loads((ckpt / "config.json").read_text()), "dir": ckpt}


@pytest.fixture
def srv(shards: dict[str, Any]) -> Iterator[HostileServer]:
    with HostileServer(shards=shards["files"], config=shards["config"], meta={"config.json": CONFIG}) as s:
        yield s


def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stall is 1 s without 4 KiB (RESHARD_CLIENT_STALL, RESHARD_CLIENT_MIN_RATE)."""
    monkeypatch.setenv("RESHARD_CLIENT_STALL", "1")
    monkeypatch.setenv("RESHARD_CLIENT_MIN_RATE", "4096")


def _everything(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# --- --meta: where the bytes go, how many ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["../x", "./../x", "/ABS", "./" + "../" * 30 + "ABS", "sub/config.json"])
def test_pull_meta_never_writes_where_the_listing_points(srv: HostileServer, tmp_path: Path, name: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "abs" / "x"
    name = name.replace("/ABS", str(target)).replace("ABS", str(target).lstrip("/"))
    srv.listing = [{"name": "config.json", "size": len(CONFIG), "sha256": hashlib.sha256(CONFIG).hexdigest()},
                   {"name": name, "size": len(CONFIG), "sha256": hashlib.sha256(CONFIG).hexdigest()}]
    srv.meta_body[name] = CONFIG
    dest = tmp_path / "dest" / "model"
    assert main(["pull", srv.url, "--meta", "-o", str(dest)]) == 1
    err = capsys.readouterr().err
    assert "which is not one of a checkpoint's small files" in err and "nothing was written" in err, err
    assert not target.exists() and not (tmp_path / "dest" / "x").exists() and not (tmp_path / "x").exists()
    assert _everything(tmp_path / "dest") == []  # not even config.json: the listing is checked whole first
    assert [r for r in srv.requests if "/meta/" in r[1]] == []  # and before any file is fetched


def test_pull_model_dir_checks_the_listing_too(srv: HostileServer, tmp_path: Path) -> None:
    from reshard.integrations.vllm import pull_model_dir  # no vLLM needed for the helper

    srv.listing = [{"name": f"f{i}.json", "size": 1, "sha256": "0" * 64} for i in range(300)]
    with pytest.raises(IntegrityError, match=r"lists 'f0.json', which is not one of a checkpoint's small files"):
        pull_model_dir(srv.url, tmp_path / "m")
    assert _everything(tmp_path) == []
    srv.listing = None
    assert pull_model_dir(srv.url, tmp_path / "m") == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").read_bytes() == CONFIG


@pytest.mark.parametrize("body", ["endless", "longer"])
def test_a_small_file_is_taken_up_to_its_listed_size_only(srv: HostileServer, tmp_path: Path, body: str) -> None:
    """Listed at 10 bytes: an endless body (no Content-Length), or 4 MiB with its own Content-Length."""
    srv.listing = [{"name": "config.json", "size": 10, "sha256": hashlib.sha256(b"x" * 10).hexdigest()}]
    srv.meta_body["config.json"] = endless() if body == "endless" else b"x" * (4 << 20)
    says = "the body runs past the 10 bytes it was listed with" if body == "endless" else \
        f"the server said 10 bytes, now {4 << 20}"
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match=says):
        ShardClient(srv.url, retries=1).pull_meta(tmp_path / "m")
    assert time.monotonic() - t0 < 30
    assert _everything(tmp_path) == []  # no temp file, no directory


def test_symlinks_planted_in_the_meta_directory_are_replaced_not_written_through(srv: HostileServer,
                                                                                tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "config.json").symlink_to(victim)
    (dest / ".config.json.part").symlink_to(victim)  # where the temp file used to be, at a fixed name
    ShardClient(srv.url).pull_meta(dest)
    assert victim.read_bytes() == b"precious"
    assert not (dest / "config.json").is_symlink() and (dest / "config.json").read_bytes() == CONFIG
    assert _everything(dest) == [".config.json.part", "config.json"]  # the planted link stays, unused


# --- shards: the temp names, the deadline, the parse before publishing ------------------------------------

def test_pull_never_writes_through_symlinks_at_its_temp_names(srv: HostileServer, shards: dict[str, Any],
                                                             tmp_path: Path) -> None:
    victims = [tmp_path / "v1", tmp_path / "v2"]
    for v in victims:
        v.write_bytes(b"precious")
    dest = tmp_path / "out" / "r0.safetensors"
    dest.parent.mkdir()
    dest.with_name(f".{dest.name}.part").symlink_to(victims[0])
    dest.with_name(f".{dest.name}.part.json").symlink_to(victims[1])
    result = ShardClient(srv.url).pull(0, 2, dest, progress=False)
    assert [v.read_bytes() for v in victims] == [b"precious"] * 2
    assert dest.read_bytes() == shards["files"][(0, 2)] and result["resumed_from"] == 0
    assert _everything(dest.parent) == [dest.name]


def test_a_trickling_server_fails_the_pull_within_its_deadline(srv: HostileServer, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte every 0.2 s: each read returns before any timeout, but 5 bytes a second is under the pace."""
    _fast(monkeypatch)
    srv.trickle = 0.2
    dest = tmp_path / "r0.safetensors"
    t0 = time.monotonic()
    with pytest.raises(ReshardError, match=r"giving up after 1 retries at byte \d+: .*stalled: \d+ bytes in 1.\d s, "
                                           r"under the minimum of 4096 bytes/s over 1 s"):
        ShardClient(srv.url, retries=1).pull(0, 2, dest, progress=False)
    assert time.monotonic() - t0 < 15
    assert not dest.exists()
    with pytest.raises(ReshardError, match=r"giving up after 1 retries at byte \d+: .*stalled"):
        body = ShardBody(srv.url, 0, 2, retries=1)  # fill_model's client
        body.readinto(memoryview(bytearray(body.size)))
    assert time.monotonic() - t0 < 30


def test_a_lying_content_length_fails_at_once(srv: HostileServer, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The body's Content-Length claims 1000 bytes more than the shard has, then the server waits."""
    _fast(monkeypatch)
    srv.extra_length = 1000
    size = len(srv.body[(0, 2)])
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match=rf"the server said {size} bytes, now {size + 1000}"):
        ShardClient(srv.url, retries=5).pull(0, 2, tmp_path / "r0", progress=False)
    assert time.monotonic() - t0 < 10  # not a try per timeout
    assert _everything(tmp_path) == []


@pytest.mark.parametrize("lie", ["past-the-end", "rank-1-as-rank-0"])
def test_pull_parses_the_shard_before_publishing_it(srv: HostileServer, shards: dict[str, Any], tmp_path: Path,
                                                    lie: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The server's digest is the true sha256 of what it sends: only parsing the shard finds the lie."""
    files = shards["files"]
    # past the end: the file cut 4 KiB short, so that its header describes bytes beyond its end
    srv.body[(0, 2)] = files[(0, 2)][:-4096] if lie == "past-the-end" else files[(1, 2)]
    dest = tmp_path / "out" / "r0.safetensors"
    assert main(["pull", srv.url, "--rank", "0", "--tp", "2", "-o", str(dest), "--no-progress"]) == 1
    err = capsys.readouterr().err
    says = ("bytes but tensors need" if lie == "past-the-end" else
            "the server sent the shard of rank 1 of tp=2 when asked for rank 0 of tp=2; nothing was published")
    assert says in err, err
    assert _everything(tmp_path / "out") == [] if (tmp_path / "out").exists() else True
    srv.body[(0, 2)] = files[(0, 2)]
    assert main(["pull", srv.url, "--rank", "0", "--tp", "2", "-o", str(dest), "--no-progress"]) == 0
    assert dest.read_bytes() == files[(0, 2)]


def _flipped(data: bytes) -> bytes:
    """`data` with 4 KiB in the middle of its tensor bytes inverted."""
    at = len(data) // 2
    return data[:at] + bytes(b ^ 0xFF for b in data[at : at + 4096]) + data[at + 4096 :]


@pytest.mark.parametrize("lie", ["flipped", "zeros"])
def test_every_consumer_of_a_service_url_checks_the_digest(srv: HostileServer, shards: dict[str, Any], tmp_path: Path,
                                                           lie: str) -> None:
    """4 KiB flipped under the true advertised digest, or the true bytes under a digest of zeros: `reshard
    pull`, `fill_model` and the trainer's `build_model` (world 1) all refuse them."""
    import reshard
    from reshard.trainer.build import build_model

    files = shards["files"]
    for key in ((0, 2), (0, 1)):
        if lie == "flipped":
            srv.digest[key] = hashlib.sha256(files[key]).hexdigest()
            srv.body[key] = _flipped(files[key])
        else:
            srv.digest[key] = "0" * 64
    with pytest.raises(IntegrityError, match="sha256 of the .* bytes received is .*, the server says"):
        ShardClient(srv.url).pull(0, 2, tmp_path / "r0", progress=False)
    assert _everything(tmp_path) == []
    model = reshard.empty_tp_model(srv.url)
    with pytest.raises(IntegrityError, match=r"sha256 \w+ does not match the recorded"):
        reshard.fill_model(model, srv.url)
    with pytest.raises(IntegrityError, match=r"sha256 \w+ does not match the recorded"):
        build_model(srv.url)


@pytest.mark.parametrize("lie", ["flipped", "zeros"])
def test_read_boxes_checks_the_digest_too(srv: HostileServer, shards: dict[str, Any], lie: str) -> None:
    """`read_boxes` from the service (`POST .../boxes`): the answer's bytes under a wrong digest are refused."""
    from reshard.fill.box_fill import read_boxes
    from reshard.format.box_request import Box

    srv.boxes_source = shards["dir"]
    boxes = [Box("model.embed_tokens.weight", (0, 0), (256, 64)), Box("lm_head.weight", (8, 0), (100, 64))]
    want = read_boxes(shards["dir"], boxes)  # planned here from the checkpoint: the reference
    got = read_boxes(srv.url, boxes)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if lie == "flipped":
        srv.boxes_edit = _flipped
    else:
        srv.boxes_digest = "0" * 64
    with pytest.raises(IntegrityError, match=r"/boxes \(2 boxes\): sha256 \w+ of the answer does not match the server's"):
        read_boxes(srv.url, boxes)


# --- credentials in the URL ---------------------------------------------------------------------------

def test_credentials_in_the_url_are_sent_but_never_printed(srv: HostileServer, shards: dict[str, Any],
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret_url = srv.url.replace("http://", "http://alice:s3cret@")
    srv.body[(0, 2)] = shards["files"][(1, 2)]  # a failure whose message names the URL
    assert main(["pull", secret_url, "--rank", "0", "--tp", "2", "-o", str(tmp_path / "r0"), "--no-progress"]) == 1
    assert main(["pull", secret_url.replace("/ck", "/nope"), "--rank", "0", "--tp", "2", "-o", str(tmp_path / "r0"),
                 "--no-progress", "--retries", "0"]) == 1
    err = capsys.readouterr().err
    assert "127.0.0.1" in err and "s3cret" not in err and "alice" not in err, err
    basic = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert {r[2].get("Authorization") for r in srv.requests} == {basic}  # every request authenticated
    srv.requests.clear()
    srv.send_sha = False  # the digest asked for afterwards: with the same credentials
    with pytest.raises(IntegrityError) as e:
        body = ShardBody(secret_url, 0, 2)  # fill_model's client: it used to drop the credentials
        body.readinto(memoryview(bytearray(body.size)))
        body.expected_sha256()
        raise IntegrityError(body.name)
    assert "s3cret" not in str(e.value) and {r[2].get("Authorization") for r in srv.requests} == {basic}
    assert [r[1].split("?")[0] for r in srv.requests] == [f"/v1/checkpoints/ck/shards/0{d}" for d in ("", "/digest")]
