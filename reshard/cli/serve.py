"""`reshard serve --root DIR [--host 127.0.0.1] [--port 8000] [--token TOKEN] [--out DIR] [--workers N]` on uvicorn.

Every setting can also come from a `RESHARD_*` environment variable; flags override them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import socket
from typing import Any

from reshard.cli.common import command
from reshard.errors import ReshardError


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from reshard.service.serve_settings import Settings

    flags = {
        "root": args.root, "host": args.host, "port": args.port, "token": args.token, "out": args.out,
        "max_upload_bytes": args.max_upload_bytes, "chunk_size": args.chunk_size, "log_level": getattr(args, "log_level", None),  # uvicorn's
        "public_docs": args.public_docs, "workers": args.workers, "zero_copy": args.zero_copy,
        "gather_cache": args.gather_cache, "store_cache": args.store_cache, "store_cache_dir": args.store_cache_dir,
        "max_header_bytes": args.max_header_bytes,
        "max_headers": args.max_headers, "max_url_bytes": args.max_url_bytes,
        "keep_alive_timeout": args.keep_alive_timeout, "worker_healthcheck_timeout": args.worker_healthcheck_timeout,
    }
    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as e:
        errors = e.errors()
        if any(err["type"] == "missing" and tuple(err["loc"]) == ("root",) for err in errors):
            raise ReshardError("serve: no folder of checkpoints given; pass --root DIR (or set RESHARD_ROOT=DIR), "
                               "a directory whose subdirectories are checkpoints, or a store prefix (s3://...)") from None
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in errors)
        raise ReshardError(f"serve: {problems} (flags or RESHARD_* environment variables)") from None


class CannotServe(ReshardError):
    """`reshard serve` cannot start where it was told to: exit status 3, as when uvicorn cannot bind."""

    exit_status = 3


def check_port(host: str, port: int) -> None:
    """One line, before uvicorn starts, when `host:port` cannot be bound (in use, not this machine's address,
    privileged): uvicorn would only log `[Errno 98]`. Bound as uvicorn binds (SO_REUSEADDR), then released."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CannotServe(f"serve: --host {host}: {e.strerror}; give an address of this machine, e.g. 127.0.0.1 or "
                           "0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CannotServe(f"serve: port {port} on {host} is in use (another reshard serve?); pick a free one "
                                   "with --port N (or RESHARD_PORT), or stop what holds it") from None
            if e.errno == errno.EACCES:
                raise CannotServe(f"serve: port {port} needs privileges this user lacks; pick one above 1023 with "
                                   "--port N") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise CannotServe(f"serve: --host {host} is not an address of this machine; give 127.0.0.1 (this "
                                   "machine only) or 0.0.0.0 (every interface)") from None
            raise CannotServe(f"serve: cannot bind {host}:{port}: {e.strerror}; pick another --host or --port") from None


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    check_port(settings.host, settings.port)
    if settings.workers > 1:
        from reshard.service.process.workers import serve_workers

        return serve_workers(settings, workers=settings.workers, access_log=not args.no_access_log)

    import uvicorn

    from reshard.service.api.app import create_app
    from reshard.service.process.lifecycle import enable_mapped_reads
    from reshard.service.process.workers import uvicorn_options

    enable_mapped_reads(settings)
    app = create_app(settings)  # its lifespan stops write jobs at SIGTERM, before uvicorn drains connections
    config = uvicorn.Config(app, access_log=not args.no_access_log, **uvicorn_options(settings))
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3  # uvicorn has logged why it did not start (port in use...)


def add_commands(sub: Any) -> None:
    p = command(sub, "serve", help="serve rank shards of the checkpoints under a root over HTTP", description=__doc__,
                examples_=("reshard serve --root checkpoints/                    # http://127.0.0.1:8000/docs",
                           "reshard serve --root checkpoints/ --port 9000 --token SECRET --host 0.0.0.0",
                           "RESHARD_ROOT=checkpoints/ reshard serve --workers 4 --log-level warning",
                           "reshard serve --root s3://bucket/models"))
    p.add_argument("--root", help="directory whose subdirectories are checkpoints (env RESHARD_ROOT)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--token", help="require `Authorization: Bearer TOKEN` everywhere but /healthz")
    p.add_argument("--out", help="directory for write jobs (default ROOT/.reshard/out)")
    p.add_argument("--max-upload-bytes", type=int, help="largest accepted upload")
    p.add_argument("--chunk-size", type=int, help="bytes per streamed chunk that is read and copied (default 8 MiB)")
    p.add_argument("--workers", type=int, help="worker processes sharing the port (default: one per core)")
    p.add_argument("--no-zero-copy", dest="zero_copy", action="store_false", default=None,
                   help="copy every byte through Python instead of sendfile (env RESHARD_ZERO_COPY=false)")
    p.add_argument("--gather-cache", type=int, metavar="BYTES",
                   help="keep copies of the row-split pieces of shards pulled more than once, up to BYTES in "
                        "ROOT/.reshard/gathered or RESHARD_GATHER_DIR (default 8 GiB; 0: off; env RESHARD_GATHER_CACHE)")
    p.add_argument("--store-cache", type=int, metavar="BYTES",
                   help="for a root in a store: keep up to BYTES of its objects' blocks on local disk, each fetched "
                        "once for every rank and layout (default 16 GiB; 0: off; env RESHARD_STORE_CACHE)")
    p.add_argument("--store-cache-dir", metavar="DIR", help="where those blocks go (default ~/.cache/reshard/serve-HASH/"
                   "store-cache; env RESHARD_STORE_CACHE_DIR)")
    p.add_argument("--max-header-bytes", type=int, metavar="BYTES",
                   help="largest request header fields, in all (default 64 KiB; 431 above it)")
    p.add_argument("--max-headers", type=int, metavar="N", help="most header fields of a request (default 100; 431 above)")
    p.add_argument("--max-url-bytes", type=int, metavar="BYTES",
                   help="longest request target, path and query (default 8 KiB; 414 above it)")
    p.add_argument("--keep-alive-timeout", type=float, metavar="SECONDS",
                   help="idle connections close after it; a request head must arrive within it (default 30)")
    p.add_argument("--worker-healthcheck-timeout", type=float, metavar="SECONDS",
                   help="with --workers N: a worker that does not answer the supervisor's ping within it is "
                        "killed and replaced (default 30)")
    p.add_argument("--public-docs", action="store_true", default=None,
                   help="the API page (/docs, /redoc) and /openapi.json without the token")
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    p.set_defaults(func=cmd_serve)


__all__ = ["CannotServe", "ReshardError", "add_commands", "check_port", "cmd_serve"]
