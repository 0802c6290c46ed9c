"""The API page as a person uses it, in headless Chromium with no way out (tests/support/browser.py): /docs
and /redoc render from the service's own files and load nothing from elsewhere, and Swagger's Authorize
with the bearer token, then Try it out / Execute, gets a secured route's answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.browser import Chromium
from tests.support.live import live_server, make_ckpt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOKEN = "browser-s3cret"


def _click(page: Chromium, selector: str) -> None:
    page.wait_for(f"!!document.querySelector({json.dumps(selector)})")
    page.js(f"document.querySelector({json.dumps(selector)}).click()")


def test_swagger_authorize_and_execute_offline(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_ckpt(root / "tiny")
    with live_server(root, token=TOKEN, public_docs="true") as srv, Chromium() as page:
        page.goto(f"{srv.url}/docs")
        _click(page, ".btn.authorize")  # the page rendered: the bundle and the OpenAPI document loaded
        assert "HTTPBearer" in page.wait_for("document.querySelector('.modal-ux')?.innerText")
        page.js("document.querySelector('.modal-ux input').focus()")
        page.type(TOKEN)
        _click(page, ".modal-ux .auth-btn-wrapper .authorize")
        page.wait_for("document.querySelector('.modal-ux')?.innerText.includes('Authorized')")
        _click(page, ".modal-ux .btn-done")
        # GET /v1/checkpoints: expand, Try it out, Execute
        page.js("[...document.querySelectorAll('.opblock-summary-path')].find(e => e.dataset.path === "
                "'/v1/checkpoints').closest('.opblock').querySelector('.opblock-summary-control').click()")
        _click(page, ".try-out__btn")
        _click(page, ".execute")
        status = page.wait_for("document.querySelector('.live-responses-table .response .response-col_status')"
                               "?.innerText")
        body = page.js("document.querySelector('.live-responses-table .response .microlight').innerText")
        curl = page.js("document.querySelector('.curl-command').innerText")
        assert status.strip() == "200", (status, body)
        assert [c["name"] for c in json.loads(body)["checkpoints"]] == ["tiny"]
        assert f"Authorization: Bearer {TOKEN}" in curl
        # ReDoc renders the same document
        page.goto(f"{srv.url}/redoc")
        assert "reshard" in page.wait_for("document.querySelector('.api-content h1')?.innerText")
        # everything the pages asked for came from the service
        assert page.requests and all(u.startswith(srv.url + "/") for u in page.requests), page.requests
        assert {f"{srv.url}/docs/assets/swagger-ui-bundle.js", f"{srv.url}/docs/assets/redoc.standalone.js",
                f"{srv.url}/openapi.json"} <= set(page.requests)
