"""Servers for the service comparison: `reshard serve`, nginx (sendfile on) and a FastAPI FileResponse app.

Each runs on 127.0.0.1 on a free port, as a child of the benchmark, started and stopped (by its own pid)
by `reshard.testing.local_servers.server`. nginx is installed with apt-get when it is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from bench.compare_write import reshard_bin

REPO = Path(__file__).resolve().parents[1]


def ensure_nginx() -> str:
    """Path of the nginx binary, installing it with apt-get first if it is missing."""
    found = shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx")
    if found:
        return str(found)
    print("bench: nginx is missing; installing it with apt-get", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-qq", "nginx"], check=True, env=env, stdout=subprocess.DEVNULL)
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    _stop_packaged_nginx()
    return found


def _stop_packaged_nginx() -> None:
    """The Debian package may start its own nginx on port 80; stop that one (by its pid file) if so."""
    pid_file = Path("/run/nginx.pid")
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text().strip()), signal.SIGQUIT)


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes {workers};
user root;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 30;
    client_body_temp_path {work}/tmp;
    proxy_temp_path {work}/tmp;
    fastcgi_temp_path {work}/tmp;
    uwsgi_temp_path {work}/tmp;
    scgi_temp_path {work}/tmp;
    types {{ application/octet-stream safetensors; }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def nginx_argv(nginx: str, root: Path, work: Path, port: int, workers: int = 2) -> list[str]:
    root, work = Path(root).resolve(), Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "tmp").mkdir(exist_ok=True)
    conf = work / "nginx.conf"
    conf.write_text(NGINX_CONF.format(work=work, root=root, port=port, workers=workers))
    return [nginx, "-p", str(work), "-c", str(conf)]


def reshard_serve_argv(root: Path, port: int, *, workers: int = 1) -> list[str]:
    return [reshard_bin(), "serve", "--root", str(root), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--no-access-log", "--workers", str(workers)]


def fileserver_argv(root: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "reshard.testing.fileserver", "--root", str(root), "--port", str(port)]
