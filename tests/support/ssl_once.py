"""One TLS context for every httpx client of the test process.

Each `httpx.Client` (and each `httpx.get(...)`, which makes one) builds a TLS context and loads the CA
bundle into it: ~30 ms of CPU, for servers the tests reach over plain HTTP on 127.0.0.1. The tests make
thousands (polling loops, fresh connections on purpose), and on a 2-core machine that CPU is taken from the
servers under test (tests/hardening/test_temp_files.py's 400-client race: 26 s of the test process's CPU,
13 s with this). `share_tls_context()` makes httpx build the context once per set of options; a context is
safe to share between clients and threads. Only where httpx has the function this replaces (else nothing).
"""

from __future__ import annotations

import functools
from typing import Any


def share_tls_context() -> None:
    try:
        import httpx._config as config
        import httpx._transports.default as transports
    except ImportError:
        return
    make = getattr(transports, "create_ssl_context", None)
    if make is None or getattr(make, "_shared", False):
        return

    @functools.lru_cache(maxsize=8)
    def cached(verify: bool, trust_env: bool) -> Any:
        return make(verify=verify, cert=None, trust_env=trust_env)

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if isinstance(verify, bool) and cert is None:
            return cached(verify, trust_env)
        return make(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context._shared = True  # type: ignore[attr-defined]
    transports.create_ssl_context = create_ssl_context
    config.create_ssl_context = create_ssl_context
