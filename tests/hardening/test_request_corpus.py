"""Bad requests against one live server: the exact status and `{"error", "detail"}` body, nothing new on
disk, and the server still healthy after each. Requests are written by hand on a raw socket, so `..`,
`%2f`, `%00` and odd headers reach the server exactly as sent. Then `reshard pull`'s one-line errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from tests.support.hard import live_server, raw_http, tree
from tests.support.live import LiveServer, make_ckpt

pytestmark = pytest.mark.timeout(120)

MAX_UPLOAD, MAX_BODY = 100_000, 10_000
NAME_RULE = "is not allowed: use 1-128 letters, digits"
S = "/v1/checkpoints/llama/shards"
BIG = "9" * 5000  # more digits than Python parses into an int by default


@pytest.fixture(scope="module")
def corpus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path, Path]]:
    base = tmp_path_factory.mktemp("corpus")
    root = base / "root"
    make_ckpt(root / "llama", vocab_size=250, num_key_value_heads=4)
    with live_server(root, out=base / "out", max_upload_bytes=MAX_UPLOAD, max_body_bytes=MAX_BODY,
                     chunk_size=64 << 10) as srv:
        yield srv, root, base
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def reference(corpus_server: tuple[LiveServer, Path, Path]) -> bytes:
    """rank 0 of tp=1 as `reshard write` writes it."""
    from reshard.cli import main

    _, root, base = corpus_server
    assert main(["write", str(root / "llama"), "--tp", "1", "-o", str(base / "ref"), "--no-progress"]) == 0
    return (base / "ref" / rank_file_name(0, 1)).read_bytes()


def _get(target: str, **headers: str) -> tuple[str, bytes]:
    lines = [f"GET {target} HTTP/1.1", "Host: x"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines), b""


def _send(method: str, target: str, body: bytes, ctype: str = "application/json") -> tuple[str, bytes]:
    return f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}", body


def _chunked(target: str, pieces: list[bytes]) -> tuple[str, bytes]:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return f"PUT {target} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked", body


def _job(obj: Any) -> tuple[str, bytes]:
    return _send("POST", "/v1/checkpoints/llama/jobs", json.dumps(obj).encode())


def _upload(target: str, body: bytes = b"{}") -> tuple[str, bytes]:
    return _send("PUT", target, body, "application/octet-stream")


# id -> (request, status, error, detail substring)
CASES: dict[str, tuple[tuple[str, bytes], int, str, str]] = {
    # rank and tp
    "rank-equals-tp": (_get(f"{S}/2?tp=2"), 422, "PlanError", "rank=2 is out of range for tp=2 (0..1)"),
    "rank-far-above-tp": (_get(f"{S}/4095?tp=4"), 422, "PlanError", "rank=4095 is out of range for tp=4"),
    "rank-negative": (_get(f"{S}/-1?tp=2"), 422, "ValidationError", "path.rank: Input should be greater than or equal to 0"),
    "rank-not-integer": (_get(f"{S}/1e1?tp=2"), 422, "ValidationError", "path.rank: Input should be a valid integer"),
    "rank-huge": (_get(f"{S}/{BIG}?tp=2"), 422, "ValidationError", "path.rank: Unable to parse input string"),
    "tp-zero": (_get(f"{S}/0?tp=0"), 422, "ValidationError", "query.tp: Input should be greater than or equal to 1"),
    "tp-negative": (_get(f"{S}/0?tp=-3"), 422, "ValidationError", "query.tp: Input should be greater than or equal to 1"),
    "tp-absurd": (_get(f"{S}/0?tp=5000"), 422, "ValidationError", "query.tp: Input should be less than or equal to 4096"),
    "tp-huge": (_get(f"{S}/0?tp={BIG}"), 422, "ValidationError", "query.tp: Unable to parse input string"),
    "tp-max-not-divisible": (_get(f"{S}/0?tp=4096"), 422, "PlanError", "not divisible by tp=4096"),
    "tp-not-divisible": (_get(f"{S}/0?tp=3"), 422, "PlanError", "not divisible by tp=3; pick a tp that plans this checkpoint: 1, 2, 4"),
    "tp-word": (_get(f"{S}/0?tp=two"), 422, "ValidationError", "query.tp: Input should be a valid integer"),
    "tp-float": (_get(f"{S}/0?tp=1.5"), 422, "ValidationError", "query.tp: Input should be a valid integer"),
    "tp-empty": (_get(f"{S}/0?tp="), 422, "ValidationError", "query.tp: Input should be a valid integer"),
    "tp-repeated": (_get(f"{S}/0?tp=2&tp=4"), 422, "ValidationError", "query.tp: given 2 times; give it once"),
    "tp-repeated-same": (_get(f"{S}/0?tp=2&tp=2"), 422, "ValidationError", "query.tp: given 2 times"),
    "tp-float-whole": (_get(f"{S}/0?tp=2.0"), 422, "ValidationError", "query.tp: '2.0' is not a plain decimal"),
    "tp-plus": (_get(f"{S}/0?tp=%2B2"), 422, "ValidationError", "query.tp: '+2' is not a plain decimal"),
    "tp-space": (_get(f"{S}/0?tp=%202"), 422, "ValidationError", "query.tp: ' 2' is not a plain decimal"),
    "tp-leading-zero": (_get(f"{S}/0?tp=02"), 422, "ValidationError", "query.tp: '02' is not a plain decimal"),
    "fsdp-repeated-plan": (_get("/v1/checkpoints/llama/plan?tp=1&fsdp=2&fsdp=2"), 422, "ValidationError",
                           "query.fsdp: given 2 times"),
    "digest-tp-plus": (_get(f"{S}/0/digest?tp=%2B1"), 422, "ValidationError", "query.tp: '+1' is not a plain decimal"),
    "plan-tp-zero": (_get("/v1/checkpoints/llama/plan?tp=0"), 422, "ValidationError", "query.tp: Input should be greater"),
    "digest-rank-equals-tp": (_get(f"{S}/4/digest?tp=4"), 422, "PlanError", "rank=4 is out of range for tp=4"),
    "tensors-not-bool": (_get("/v1/checkpoints/llama/plan?tp=2&tensors=maybe"), 422, "ValidationError",
                         "query.tensors: Input should be a valid boolean"),
    # names and labels
    "name-dotdot": (_get("/v1/checkpoints/../plan?tp=1"), 400, "BadRequest", f"checkpoint name '..' {NAME_RULE}"),
    "name-encoded-dotdot": (_get("/v1/checkpoints/%2e%2e/plan?tp=1"), 400, "BadRequest", f"checkpoint name '..' {NAME_RULE}"),
    "name-encoded-slash": (_get("/v1/checkpoints/..%2f..%2fetc/plan?tp=1"), 404, "NotFound",
                           "no route GET /v1/checkpoints/../../etc/plan"),
    "name-absolute": (_get("/v1/checkpoints/%2fetc%2fpasswd"), 404, "NotFound", "no route GET /v1/checkpoints//etc/passwd"),
    "name-nul": (_get("/v1/checkpoints/llama%00/plan?tp=1"), 400, "BadRequest", f"checkpoint name 'llama\\x00' {NAME_RULE}"),
    "name-state-dir": (_get("/v1/checkpoints/.reshard"), 400, "BadRequest", f"checkpoint name '.reshard' {NAME_RULE}"),
    "name-too-long": (_get("/v1/checkpoints/" + "a" * 200), 400, "BadRequest", NAME_RULE),
    "name-unknown": (_get("/v1/checkpoints/nope/plan?tp=1"), 404, "NotFoundError", "no checkpoint named 'nope'"),
    "label-escape": (_get("/v1/checkpoints/llama/plan?tp=1&rules=..%2fx"), 400, "BadRequest",
                     f"manifest label '../x' {NAME_RULE}"),
    "label-nul": (_get("/v1/checkpoints/llama/rules?label=a%00"), 400, "BadRequest", "manifest label 'a\\x00'"),
    "label-unknown": (_get("/v1/checkpoints/llama/plan?tp=1&rules=nope"), 404, "NotFoundError", "no stored manifest 'nope'"),
    # ranges that are well formed but unsatisfiable
    "range-past-end": (_get(f"{S}/0?tp=1", Range="bytes=999999999-"), 416, "RangeNotSatisfiable",
                       "starts at or past the end of the"),
    "range-empty-suffix": (_get(f"{S}/0?tp=1", Range="bytes=-0"), 416, "RangeNotSatisfiable", "an empty suffix"),
    "range-5000-digits": (_get(f"{S}/0?tp=1", Range=f"bytes={BIG}-"), 416, "RangeNotSatisfiable",
                          "starts at or past the end of the"),
    # uploads
    "upload-bad-type": (_upload("/v1/checkpoints/llama/files/evil.py"), 400, "BadRequest", "file name 'evil.py' is not accepted"),
    "upload-nul": (_upload("/v1/checkpoints/llama/files/x%00.safetensors"), 400, "BadRequest", "file name 'x\\x00.safetensors'"),
    "upload-dotdot-file": (_upload("/v1/checkpoints/llama/files/..%2fx.safetensors"), 404, "NotFound", "no route PUT"),
    "upload-dotdot-name": (_upload("/v1/checkpoints/%2e%2e/files/x.safetensors"), 400, "BadRequest", "checkpoint name '..'"),
    "upload-too-large": (_upload("/v1/checkpoints/new/files/model.safetensors", bytes(MAX_UPLOAD + 1)), 413,
                         "PayloadTooLarge", f"{MAX_UPLOAD + 1} bytes exceeds the {MAX_UPLOAD}-byte upload limit"),
    "upload-too-large-chunked": (_chunked("/v1/checkpoints/new/files/model.safetensors", [bytes(40_000)] * 3), 413,
                                 "PayloadTooLarge", f"more than the {MAX_UPLOAD}-byte upload limit"),
    "upload-truncated": (_upload("/v1/checkpoints/new/files/model.safetensors", b"\x10" + bytes(7) + b"{}"), 422,
                         "HeaderError", "new/model.safetensors (upload)"),
    "upload-json-brackets": (_upload("/v1/checkpoints/new/files/config.json", b"[" * 100_000), 422, "CheckpointError",
                             "config.json: JSON nested deeper than 64 levels"),
    "upload-json-deep": (_upload("/v1/checkpoints/new/files/config.json",
                                 b'{"a": ' * 900 + b"1" + b"}" * 900), 422, "CheckpointError",
                         "config.json: JSON nested deeper than 64 levels"),
    "upload-index-deep": (_upload("/v1/checkpoints/new/files/model.safetensors.index.json",
                                  b'{"weight_map": {}, "x": ' + b"[" * 70 + b"]" * 70 + b"}"), 422, "CheckpointError",
                          "model.safetensors.index.json: JSON nested deeper than 64 levels"),
    "rules-too-large": (_send("PUT", "/v1/checkpoints/llama/rules", b" " * (MAX_BODY + 1)), 413, "PayloadTooLarge",
                        f"request body of {MAX_BODY + 1} bytes exceeds the {MAX_BODY}-byte limit"),
    "rules-tp-zero": (_send("PUT", "/v1/checkpoints/llama/rules?tp=0", b'{"rules": []}'), 422, "ValidationError",
                      "query.tp.0: Input should be greater than or equal to 1"),
    # jobs
    "job-tp-zero": (_job({"tp": 0}), 422, "ValidationError", "tp: Input should be greater than or equal to 1"),
    "job-rank-equals-tp": (_job({"tp": 2, "ranks": [2]}), 422, "PlanError", "rank=2 is out of range for tp=2"),
    "job-tp-string": (_job({"tp": "2"}), 422, "ValidationError", "tp: Input should be a valid integer"),
    "job-extra-field": (_job({"tp": 2, "out": "/tmp"}), 422, "ValidationError", "out: Extra inputs are not permitted"),
    "job-label-escape": (_job({"tp": 2, "rules": "../x"}), 422, "ValidationError", "rules: String should match pattern"),
    "job-not-json": (_send("POST", "/v1/checkpoints/llama/jobs", b"{not json"), 422, "ValidationError", "JSON decode error"),
    "job-unknown-checkpoint": (_send("POST", "/v1/checkpoints/nope/jobs", b'{"tp": 1}'), 404, "NotFoundError",
                               "no checkpoint named 'nope'"),
    "job-id-too-long": (_get("/v1/jobs/" + "x" * 65), 422, "ValidationError", "path.job_id: String should have at most 64"),
    "job-id-unknown": (_get("/v1/jobs/..%2f..%2fetc"), 404, "NotFound", "no route GET /v1/jobs/../../etc"),
    # routes and methods
    "unknown-route": (_get("/v2/anything"), 404, "NotFound", "no route GET /v2/anything"),
    "wrong-method": (("DELETE /v1/checkpoints/llama HTTP/1.1\r\nHost: x", b""), 405, "MethodNotAllowed", "Method Not Allowed"),
}


@pytest.mark.pure
def test_the_corpus_is_big_enough() -> None:
    assert len(CASES) >= 30


def _split(answer: bytes) -> tuple[dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return headers, body


@pytest.mark.servers
@pytest.mark.parametrize("case", list(CASES))
def test_bad_request(corpus_server: tuple[LiveServer, Path, Path], case: str) -> None:
    srv, _, base = corpus_server
    (head, body), status, error, detail = CASES[case]
    before = tree(base / "root"), tree(base / "out") if (base / "out").exists() else {}
    got, answer = raw_http(srv, head, body)
    headers, payload = _split(answer)
    assert got == status, (case, answer[:500])
    assert headers["content-type"] == "application/json", headers
    obj = json.loads(payload)
    assert set(obj) == {"error", "detail"} and obj["error"] == error, obj
    assert detail in obj["detail"], (detail, obj["detail"])
    assert str(base) not in obj["detail"]  # no server paths in answers
    if status == 416:
        assert headers["content-range"].startswith("bytes */")
    after = tree(base / "root"), tree(base / "out") if (base / "out").exists() else {}
    assert after == before, "a refused request changed the disk"
    assert httpx.get(srv.url + "/healthz", timeout=10).json()["status"] == "ok"


@pytest.mark.servers
@pytest.mark.parametrize("value", ["bytes=abc", "bytes=0-1,5-6", "bytes=9-3", "items=0-5", "bytes=-", "bytes=\xe9-1",
                                  "bytes 0-5", "bytes=--5"])
def test_unsupported_range_is_ignored_with_the_full_body(corpus_server: tuple[LiveServer, Path, Path],
                                                         reference: bytes, value: str) -> None:
    """RFC 9110 lets a server ignore a Range it does not support: 200 and the whole, correct file."""
    srv, _, _ = corpus_server
    status, answer = raw_http(srv, *_get(f"{S}/0?tp=1", Range=value))
    headers, body = _split(answer)
    assert status == 200 and "content-range" not in headers
    assert int(headers["content-length"]) == len(reference) and body == reference


@pytest.mark.servers
def test_satisfiable_ranges_still_answer_206(corpus_server: tuple[LiveServer, Path, Path], reference: bytes) -> None:
    srv, _, _ = corpus_server
    n = len(reference)
    for value, start, end in [("bytes=10-", 10, n), ("bytes=-7", n - 7, n), (f"bytes=5-{BIG}", 5, n),
                              (f"bytes=-{BIG}", 0, n), ("bytes=" + "0" * 40 + "3-4", 3, 5)]:
        status, answer = raw_http(srv, *_get(f"{S}/0?tp=1", Range=value))
        headers, body = _split(answer)
        assert status == 206 and body == reference[start:end], value
        assert headers["content-range"] == f"bytes {start}-{end - 1}/{n}"


# --- the CLI: `reshard pull` fails with one line and leaves nothing behind --------------------------------

PULL_CASES = {
    "rank-equals-tp": (["--rank", "4", "--tp", "4"], "llama", "rank=4 is out of range for tp=4 (0..3)"),
    "tp-zero": (["--rank", "0", "--tp", "0"], "llama", "tp=0 must be an integer from 1 to 4096"),  # refused before asking
    "tp-absurd": (["--rank", "0", "--tp", "100000"], "llama", "tp=100000 must be an integer from 1 to 4096"),
    "tp-not-divisible": (["--rank", "0", "--tp", "3"], "llama", "not divisible by tp=3"),
    "rank-negative": (["--rank", "-1", "--tp", "2"], "llama", "rank=-1 is out of range for tp=2 (0..1)"),
    "unknown-checkpoint": (["--rank", "0", "--tp", "1"], "nope", "no checkpoint named 'nope'"),
    "unknown-rules": (["--rank", "0", "--tp", "1", "--rules", "nope"], "llama", "no stored manifest 'nope'"),
    "name-dotdot": (["--rank", "0", "--tp", "1"], "..", "is not a checkpoint URL"),
    "name-slash": (["--rank", "0", "--tp", "1"], "a/b", "is not a checkpoint URL"),
}


@pytest.mark.servers
@pytest.mark.parametrize("case", list(PULL_CASES))
def test_cli_pull_fails_with_one_line(corpus_server: tuple[LiveServer, Path, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str], case: str) -> None:
    from reshard.cli import main

    srv, _, _ = corpus_server
    args, name, needle = PULL_CASES[case]
    dest = tmp_path / "dl" / "shard.safetensors"
    dest.parent.mkdir()
    # A refusal (4xx) is never retried, so retries change nothing of what is asserted; they only keep a
    # dropped connection or a worker being restarted on a loaded machine (uvicorn kills a worker whose
    # health-check ping waits 5 s) from failing the case: with `--retries 0` one such hiccup did.
    rc = main(["pull", f"{srv.url}/v1/checkpoints/{name}", *args, "-o", str(dest), "--no-progress", "--retries", "3"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error: "), err
    assert needle in lines[0], (needle, lines[0])
    assert list(dest.parent.iterdir()) == []  # no partial file, no .part, no .part.json
    assert httpx.get(srv.url + "/healthz", timeout=60).status_code == 200


@pytest.mark.pure
def test_cli_pull_unreachable_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.cli import main
    from tests.support.live import free_port

    url = f"http://127.0.0.1:{free_port()}/v1/checkpoints/llama"
    rc = main(["pull", url, "--rank", "0", "--tp", "1", "-o", str(tmp_path / "x.safetensors"), "--retries", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1 and "giving up after 0 retries" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.servers
def test_a_config_on_disk_nested_too_deep_is_a_422_and_the_server_keeps_serving(
        corpus_server: tuple[LiveServer, Path, Path]) -> None:
    """A checkpoint put under the root by hand (not uploaded) whose config.json nests 900 levels: its
    routes answer 422 naming the file, never 500, and the other checkpoints are served as before."""
    import shutil

    srv, root, _ = corpus_server
    deep = root / "deep"
    deep.mkdir()
    try:
        shutil.copy(root / "llama" / "model.safetensors", deep / "model.safetensors")
        (deep / "config.json").write_text('{"a": ' * 900 + "1" + "}" * 900)
        for _ in range(2):  # and again: nothing cached a half-read checkpoint
            r = httpx.get(f"{srv.url}/v1/checkpoints/deep/plan", params={"tp": 1})
            assert r.status_code == 422 and r.json()["error"] == "CheckpointError", r.text
            assert "deep/config.json: JSON nested deeper than 64 levels" in r.json()["detail"], r.text
        assert httpx.get(f"{srv.url}/v1/checkpoints/llama/plan", params={"tp": 1}).status_code == 200
    finally:
        shutil.rmtree(deep)
