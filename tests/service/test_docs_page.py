"""The API page of a real `reshard serve` works offline: /docs and /redoc reference only the service's own
files (no CDN, no absolute URL at all), each of them answers 200 with the bytes fastapi-offline ships, the
page is readable without the token only under --public-docs, and the OpenAPI document declares the bearer
scheme that Swagger's Authorize sends on the secured routes."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from importlib.resources import files
from pathlib import Path

import httpx
import pytest

from tests.support.live import live_server, raw_request

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

TOKEN = "docs-s3cret"
# where fastapi-offline keeps the Swagger UI / ReDoc files it ships: the reference for the bytes served
SHIPPED = files("fastapi_offline") / "static"


class _Refs(HTMLParser):
    """Every URL an HTML page makes the browser load: src, href and ReDoc's spec-url attributes, and the
    `url:` Swagger UI's inline script fetches the OpenAPI document from."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self._script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [v for k, v in attrs if k in ("src", "href", "spec-url") and v]
        self._script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._script = False

    def handle_data(self, data: str) -> None:
        if self._script:
            self.refs += re.findall(r"\burl:\s*'([^']+)'", data)


def _refs(html: str) -> list[str]:
    parser = _Refs()
    parser.feed(html)
    return parser.refs


def test_docs_served_offline_with_token(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with live_server(root, token=TOKEN, public_docs="true") as srv, httpx.Client(base_url=srv.url) as c:
        for page, assets in [("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
                             ("/redoc", {"redoc.standalone.js", "favicon.png"})]:
            r = c.get(page)  # no token: --public-docs
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (page, r.text)
            # nothing the browser would fetch from elsewhere: no scheme, no protocol-relative URL
            assert re.findall(r"https?://|\"//|'//", r.text) == [], page
            refs = _refs(r.text)
            assert "/openapi.json" in refs, (page, refs)
            served = {ref.rsplit("/", 1)[1] for ref in refs if ref.startswith("/docs/assets/")}
            assert served == assets, (page, refs)
            for ref in refs:
                assert ref.startswith("/"), (page, ref)
                got = c.get(ref)
                assert got.status_code == 200, (page, ref, got.text[:200])
                if ref.startswith("/docs/assets/"):
                    assert got.content == (SHIPPED / ref.rsplit("/", 1)[1]).read_bytes(), ref
            assert "SwaggerUIBundle" in c.get("/docs/assets/swagger-ui-bundle.js").text
        assert c.get("/docs/oauth2-redirect").status_code == 200

        # Authorize: a bearer scheme, required by every route but /healthz, and what it sends works
        spec = c.get("/openapi.json").json()
        ((name, scheme),) = spec["components"]["securitySchemes"].items()
        assert (scheme["type"], scheme["scheme"]) == ("http", "bearer"), scheme
        for path, item in spec["paths"].items():
            for op in item.values():
                assert (op.get("security") == [{name: []}]) == (path != "/healthz"), (path, op.get("security"))
        assert c.get("/v1/checkpoints").status_code == 401
        assert c.get("/v1/checkpoints", headers={"Authorization": f"Bearer {TOKEN}"}).json() == {"checkpoints": []}
        # the assets folder is public, what is not under it stays behind the token
        head = raw_request(srv, "/docs/assets/../v1/checkpoints").split(b"\r\n", 1)[0]
        assert b" 200 " not in head, head
        assert c.get("/docs/assets/nope.js").status_code == 404
        assert "Traceback" not in srv.log(), srv.log()


def test_docs_need_the_token_without_public_docs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with live_server(root, token=TOKEN) as srv, httpx.Client(base_url=srv.url) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"):
            r = c.get(path)
            assert r.status_code == 401, (path, r.status_code)
            body = r.json()
            assert body["error"] == "Unauthorized" and "--public-docs" in body["detail"], body
        r = c.get("/v1/checkpoints")
        assert r.status_code == 401 and "--public-docs" not in json.dumps(r.json())
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert c.get("/docs", headers=ok).status_code == 200
        assert c.get("/docs/assets/swagger-ui.css", headers=ok).content == (SHIPPED / "swagger-ui.css").read_bytes()
