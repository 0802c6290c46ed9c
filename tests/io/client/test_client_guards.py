"""The client's guards on their own: credentials out of URLs, the download pace, the small files' listing,
temp files that are never written through a planted name (each against values worked out by hand, or
the file system's own answer)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from reshard.errors import IntegrityError
from reshard.format.meta_files import MAX_META_BYTES, check_listing
from reshard.io.client.pace import Pace, PaceLimits, Stalled
from reshard.io.client.wire import redact, without_credentials
from reshard.io.outfs import atomic_file, create_exclusive, open_own, random_temp, temp_path

pytestmark = pytest.mark.pure

SHA = "ab" * 32


def test_redact_takes_credentials_out_of_every_url_in_a_text() -> None:
    text = ("GET http://alice:s3cr%40t@host:8000/v1/checkpoints/x?tp=2: HTTP 404; also https://bob@h/p "
            "and http://h/a@b (an @ in the path stays), mailto-like user@host stays")
    assert redact(text) == ("GET http://host:8000/v1/checkpoints/x?tp=2: HTTP 404; also https://h/p "
                            "and http://h/a@b (an @ in the path stays), mailto-like user@host stays")


def test_without_credentials_moves_them_into_a_basic_header() -> None:
    url, headers = without_credentials("http://alice:s3cr%40t@host:8000/v1/checkpoints/x")
    assert url == "http://host:8000/v1/checkpoints/x"
    assert headers == {"Authorization": "Basic " + base64.b64encode(b"alice:s3cr@t").decode()}
    assert without_credentials("http://host/v1/checkpoints/x") == ("http://host/v1/checkpoints/x", {})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pace_counts_progress_per_window_and_stops_a_trickle() -> None:
    clock = Clock()
    pace = Pace(PaceLimits(stall=2.0, min_rate=1000), clock=clock)  # 2000 bytes within 2 s
    assert PaceLimits(stall=2.0, min_rate=1000).quantum == 2000
    clock.now += 1.9
    assert pace.got(1999) is False
    assert pace.got(1) is True  # a window's worth, in time: progress, and a fresh window
    for _ in range(4):  # a byte every 0.5 s: no progress, then over the limit
        clock.now += 0.5
        assert pace.got(1) is False
    clock.now += 0.5
    with pytest.raises(Stalled, match=r"^stalled: 5 bytes in 2.5 s, under the minimum of 1000 bytes/s over 2 s"):
        pace.got(1)
    pace.restart()  # a new request: its own window
    assert pace.got(2000) is True
    assert PaceLimits(stall=2.0, min_rate=1000).read_timeout(60.0) == 2.0


@pytest.mark.parametrize("name", ["../x", "./../x", "/etc/passwd", "./" + "../" * 30 + "tmp/x", "config.json/..",
                                  "sub/config.json", "model.safetensors", "", None, 7])
def test_a_listing_naming_anything_but_a_small_file_is_refused(name: object) -> None:
    with pytest.raises(IntegrityError, match=r"u/meta: the server lists .* which is not one of a checkpoint's small "
                                             r"files .*; nothing was written"):
        check_listing({"files": [{"name": "config.json", "size": 2, "sha256": SHA},
                                 {"name": name, "size": 2, "sha256": SHA}]}, "u/meta")


@pytest.mark.parametrize(("entry", "says"), [
    ({"size": -1}, "with size -1"), ({"size": MAX_META_BYTES + 1}, f"with size {MAX_META_BYTES + 1}"),
    ({"size": "10"}, "with size '10'"), ({"size": True}, "with size True"),
    ({"sha256": "0" * 63}, "with sha256 '0{63}'"), ({"sha256": "G" * 64}, "with sha256 'G{64}'"),
])
def test_a_listing_with_a_bad_size_or_digest_is_refused(entry: dict[str, object], says: str) -> None:
    with pytest.raises(IntegrityError, match=rf"the server lists config.json {says}"):
        check_listing({"files": [{"name": "config.json", "size": 2, "sha256": SHA, **entry}]}, "u/meta")


def test_a_listing_naming_a_file_twice_or_no_list_is_refused() -> None:
    twice = [{"name": "config.json", "size": 2, "sha256": SHA}] * 2
    with pytest.raises(IntegrityError, match="lists config.json twice"):
        check_listing({"files": twice}, "u")
    with pytest.raises(IntegrityError, match="the listing has no list of files"):
        check_listing({"files": {"config.json": 2}}, "u")
    assert check_listing({"files": twice[:1]}, "u") == twice[:1]


def test_temp_files_are_created_only_where_nothing_is(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / ".x.part"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_exclusive(planted)
    assert victim.read_bytes() == b"precious"
    assert open_own(planted) is None  # a symlink is never opened to resume from
    hard = tmp_path / ".y.part"
    os.link(victim, hard)
    assert open_own(hard) is None  # nor a file with another link
    (tmp_path / "own").write_bytes(b"partial")
    fd = open_own(tmp_path / "own")
    assert fd is not None and os.read(fd, 100) == b"partial"
    os.close(fd)
    names = {temp_path(tmp_path / "out").name for _ in range(20)} | {random_temp(tmp_path / "m")[0].name for _ in range(5)}
    assert len(names) == 25 and all(n.startswith((f".tmp-{os.getpid()}-", ".m.")) for n in names)
    with atomic_file(tmp_path / "out") as f:
        f.write(b"new")
    assert (tmp_path / "out").read_bytes() == b"new" and victim.read_bytes() == b"precious"
