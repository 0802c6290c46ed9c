"""API conformance: schemathesis generates requests for every operation of the app's OpenAPI schema
(valid and invalid ones) and checks every answer: never a 5xx, a documented status, content type,
headers and body schema; invalid requests are refused with a 4xx. Three ways in: no token configured; a token configured and sent; a token
configured and not sent (then everything but /healthz must be a documented 401)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from reshard.service import Settings, create_app
from tests.support.live import make_ckpt

pytestmark = [pytest.mark.pure, pytest.mark.timeout(300)]

TOKEN = "schema-t0ken"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
OPERATIONS = {  # every route of the app
    "GET /healthz", "GET /metrics", "GET /v1/checkpoints", "GET /v1/checkpoints/{name}",
    "GET /v1/checkpoints/{name}/plan", "GET /v1/checkpoints/{name}/rules", "PUT /v1/checkpoints/{name}/rules",
    "GET /v1/checkpoints/{name}/meta", "GET /v1/checkpoints/{name}/meta/{filename}",
    "PUT /v1/checkpoints/{name}/files/{filename}", "GET /v1/checkpoints/{name}/shards/{rank}",
    "HEAD /v1/checkpoints/{name}/shards/{rank}", "GET /v1/checkpoints/{name}/shards/{rank}/digest",
    "POST /v1/checkpoints/{name}/jobs", "GET /v1/jobs", "GET /v1/jobs/{job_id}",
    # a training checkpoint's optimizer state (part: "optimizer")
    "GET /v1/checkpoints/{name}/{part}/shards/{rank}", "HEAD /v1/checkpoints/{name}/{part}/shards/{rank}",
    "GET /v1/checkpoints/{name}/{part}/shards/{rank}/digest",
    # boxes of tensors the client names (and of the optimizer state's)
    "POST /v1/checkpoints/{name}/boxes", "POST /v1/checkpoints/{name}/boxes/digest",
    "POST /v1/checkpoints/{name}/{part}/boxes", "POST /v1/checkpoints/{name}/{part}/boxes/digest",
}
EXAMPLES = 12


@pytest.fixture
def api_root(tmp_path: Path) -> Path:
    """A fresh root per test: generated uploads and manifests may land in `tiny`."""
    root = tmp_path / "root"
    make_ckpt(root / "tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)
    return root


MODES = ["no-token-configured", "token-sent", "token-missing"]


def _operations(root: Path, out: Path, mode: str) -> list[Any]:
    token = None if mode == "no-token-configured" else TOKEN
    app = create_app(Settings(root=root, out=out, token=token, public_docs=True, max_upload_bytes=1 << 20))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [result.ok() for result in schema.get_all_operations()]


def _check(operation: Any, mode: str, generation: GenerationMode, seen: dict[str, set[int]]) -> None:
    """EXAMPLES generated requests to one operation, each answer checked."""
    headers = {"Authorization": f"Bearer {TOKEN}"} if mode == "token-sent" else {}

    strategy = operation.as_strategy(generation_mode=generation)
    if generation is GenerationMode.POSITIVE:  # half the requests name what exists, so they can succeed
        fixed = {k: v for k, v in {"name": "tiny", "rank": 1}.items() if f"{{{k}}}" in operation.path}
        query = {"tp": 2} if any(p.name == "tp" for p in operation.query) else None
        strategy = st.one_of(strategy, operation.as_strategy(path_parameters=fixed, query=query))

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    def run(case: Any) -> None:
        if mode != "token-sent" and case.headers:  # the generator may invent an Authorization header
            case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
        checks = CHECKS + ([negative_data_rejection] if generation is GenerationMode.NEGATIVE else [])
        response = case.call_and_validate(headers=headers, checks=checks)
        seen.setdefault(operation.label, set()).add(response.status_code)
        if mode == "token-missing" and case.path != "/healthz":
            assert response.status_code == 401, (case.method, case.formatted_path, response.status_code)
            assert case.method == "HEAD" or response.json()["error"] == "Unauthorized"
            assert response.headers.get("www-authenticate") == ["Bearer"]

    run()


@pytest.mark.parametrize("generation", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_every_operation_conforms(api_root: Path, tmp_path: Path, mode: str, generation: GenerationMode) -> None:
    operations = _operations(api_root, tmp_path / "out", mode)
    assert {op.label for op in operations} == OPERATIONS
    seen: dict[str, set[int]] = {}
    for operation in operations:
        if generation is GenerationMode.NEGATIVE and "{" not in operation.path and operation.method != "put":
            continue  # nothing to get wrong: no parameters, no body
        _check(operation, mode, generation, seen)
    print(f"\n{mode}/{generation}: " + "; ".join(f"{k} {sorted(v)}" for k, v in sorted(seen.items())))
    if generation is GenerationMode.POSITIVE and mode != "token-missing":  # valid requests also succeed
        assert any(code < 300 for codes in seen.values() for code in codes)
