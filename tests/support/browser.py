"""Headless Chromium driven over the DevTools protocol, for tests of pages as a person uses them.

    with Chromium() as page:                         # skips the test where chromium is not installed
        page.goto(url)
        page.wait_for("!!document.querySelector('.btn.authorize')")
        page.js("document.querySelector('.btn.authorize').click()")
        page.type("s3cret")                          # into the focused element, as keystrokes would
        page.requests                                # every URL the page asked for

Every host name but 127.0.0.1 resolves to nothing (`--host-resolver-rules`), as on a cluster with no way
out; `requests` still lists what the page tried to load from elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from reshard.testing.local_servers import free_port


class Chromium:
    def __init__(self, *, width: int = 1280, height: int = 1600) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:
            pytest.skip("no chromium: apt-get install -y chromium")
        self._profile = tempfile.TemporaryDirectory(prefix="reshard-chromium-")
        self._port = free_port()
        self._proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={self._profile.name}",
             f"--remote-debugging-port={self._port}", f"--window-size={width},{height}",
             "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._ws: ClientConnection | None = None
        self._stack = contextlib.ExitStack()
        self._id = 0
        self.requests: list[str] = []

    def __enter__(self) -> Chromium:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                tabs = httpx.get(f"http://127.0.0.1:{self._port}/json", timeout=2).json()
                pages = [t for t in tabs if t["type"] == "page"]
                if pages:
                    break
            assert self._proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.2)
        self._ws = self._stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=None))
        self.call("Network.enable")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._profile.cleanup()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; events that arrive meanwhile are recorded (URLs requested from a network:
        not the page's inline `data:` images)."""
        assert self._ws is not None
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=60))
            if msg.get("method") == "Network.requestWillBeSent":
                url = msg["params"]["request"]["url"]
                if not url.startswith(("data:", "blob:")):
                    self.requests.append(url)
            elif msg.get("id") == self._id:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited); a thrown error fails."""
        r = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in r, (expression, r["exceptionDetails"])
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Polls until `expression` is truthy; its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.js(expression):
                return value
            time.sleep(0.1)
        raise AssertionError(f"the page never had {expression} within {timeout} s")

    def type(self, text: str) -> None:
        self.call("Input.insertText", text=text)
