"""Service settings: environment variables `RESHARD_*`, overridden by the flags of `reshard serve`."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reshard.io.source.stores import is_url

MiB = 1 << 20
BOXES_CAP = 1 << 18  # the most boxes a request body may hold (its schema's maxItems)
STATE_DIR = ".jobs"  # under OUT, unless RESHARD_STATE names another directory


class Settings(BaseSettings):
    """Everything the app reads at start-up; `create_app(settings)` keeps it on `app.state.settings`."""

    model_config = SettingsConfigDict(env_prefix="RESHARD_", extra="ignore", frozen=True)

    root: Path | str = Field(description="directory whose subdirectories are the checkpoints served, or a store "
                             "prefix whose sub-prefixes are (s3://BUCKET/PREFIX, gs://..., http(s)://HOST/PATH)")
    host: str = Field("127.0.0.1", description="address `reshard serve` binds")
    port: int = Field(8000, ge=0, le=65535, description="port `reshard serve` binds (0: any free port)")
    token: SecretStr | None = Field(None, description="bearer token required by every endpoint but /healthz")
    out: Path | None = Field(None, description="where jobs write rank files; default ROOT/.reshard/out")
    state: Path | None = Field(None, description="the workers' shared state (SQLite of jobs and digests, job locks); "
                               "default OUT/.jobs. Keep it off a file system you may remount read-only: an open "
                               "database keeps the remount from happening")
    public_docs: bool = Field(False, description="serve the API page (/docs, /redoc, their files under "
                              "/docs/assets) and /openapi.json without the token")
    max_upload_bytes: int = Field(64 << 30, ge=1, description="largest accepted upload (413 above it)")
    max_body_bytes: int = Field(1 * MiB, ge=1, description="largest JSON request body (manifests, jobs)")
    max_boxes: int = Field(1 << 16, ge=1, le=BOXES_CAP, description="most boxes one `POST .../boxes` asks for "
                           "(400 above it; at most 262144, the most the request body's schema admits)")
    max_box_bytes: int = Field(64 << 30, ge=1, description="most tensor bytes one `POST .../boxes` answers (400 "
                               "above it)")
    max_box_runs: int = Field(1 << 18, ge=1, description="most separate runs of source bytes one `POST .../boxes` "
                              "may be made of (400 above it): a box of a few elements from every row of a tensor "
                              "costs planning and reading per row")
    max_boxes_body_bytes: int = Field(16 * MiB, ge=1, description="largest `POST .../boxes` request body (413 "
                                      "above it): ~100 bytes a box")
    chunk_size: int = Field(8 * MiB, ge=64 << 10, le=256 * MiB, description="bytes per streamed chunk of what is "
                            "read and copied (row-split runs, headers); 8 MiB: a row-split rank goes ~8% faster "
                            "than with 4 MiB (fewer hand-offs between the reader thread and the event loop)")
    send_timeout: float = Field(120.0, gt=0, description="seconds a client may take to accept one chunk of a "
                                "shard before the stream is dropped (frees its files and buffers)")
    zero_copy: bool = Field(True, description="`reshard serve` sends contiguous ranges of local source files with "
                            "sendfile (no copy through Python). A file rewritten in place mid-stream still cuts "
                            "the body short, but its bytes before the cut may then come from either version, as "
                            "with any sendfile server; publish checkpoints by rename, or turn this off")
    mapped_reads: bool = Field(True, description="`reshard serve` gathers row-split (strided) runs straight from "
                               "memory mappings of the source files, each guarded by a read lease (see "
                               "reshard.io.source.mapped_files); off: read the covering row blocks with pread and gather")
    gather_cache: int = Field(8 << 30, ge=0, description="bytes of copies of the gathered (row-split) pieces of "
                              "shards pulled whole more than once, kept in GATHER_DIR and sent with sendfile "
                              "like source ranges (see reshard.service.transport.gathered); 0: gather on every pull")
    gather_dir: Path | None = Field(None, description="where the copies of gathered pieces go, shared by the "
                                    "workers (default ROOT/.reshard/gathered)")
    store_cache: int = Field(16 << 30, ge=0, description="bytes of the node's disk cache of store objects, for a "
                             "root in a store: each block of each object version (by ETag) is fetched once while "
                             "it stays cached, for every rank, layout and worker (see reshard.io.source.store_cache); "
                             "least recently used blocks go first; 0: every pull fetches what it needs")
    store_cache_block: int = Field(8 << 20, ge=4096, le=256 * MiB, description="bytes per block of the store "
                                   "cache: one GET each, at block-aligned offsets of an object")
    store_cache_dir: Path | None = Field(None, description="where the store cache's blocks go, shared by the "
                                         "workers (default STATE/store-cache: ~/.cache/reshard/serve-HASH)")
    io_threads: int = Field(32, ge=1, le=1024, description="threads reading shard bytes for all streams")
    job_workers: int = Field(1, ge=1, le=64, description="background write jobs run at once, per worker process")
    workers: int = Field(default_factory=lambda: len(os.sched_getaffinity(0)), ge=1, le=256,
                         description="worker processes of `reshard serve` sharing the port (default: one per core)")
    max_jobs_kept: int = Field(1000, ge=1, description="finished jobs remembered for GET /v1/jobs/{id}")
    checkpoint_cache: int = Field(64, ge=1, description="parsed checkpoints kept in memory")
    plan_cache: int = Field(1 << 18, ge=1, description="tensor entries of the rank plans kept in memory (a plan "
                            "of T tensors counts T + 1; about 220 bytes each)")
    max_plan_work: int = Field(1 << 20, ge=1, description="ranks x tensors one request may plan (a JSON plan, a "
                               "write job): about 1.3 CPU-s at the default; beyond, 400 naming smaller requests")
    max_jobs_pending: int = Field(8, ge=1, description="write jobs queued or running per worker process; "
                                  "beyond, 429 (submit again later)")
    digest_cache: int = Field(4096, ge=1, description="shard sha256 digests kept (by ETag, in the store all workers share)")
    max_header_bytes: int = Field(64 << 10, ge=256, le=64 * MiB, description="largest request header fields "
                                  "(names, values and separators, in all): 431 above it, before anything else runs")
    max_headers: int = Field(100, ge=8, le=10_000, description="most header fields of one request: 431 above it")
    max_url_bytes: int = Field(8 << 10, ge=256, le=64 * MiB, description="longest request target (path and "
                               "query): 414 above it")
    keep_alive_timeout: float = Field(30.0, gt=0, le=3600, description="seconds an idle connection stays open "
                                      "between requests; a request head must also arrive whole within it, from the "
                                      "connection's start or the head's first byte (408, or a silent close if "
                                      "nothing came)")
    worker_healthcheck_timeout: float = Field(30.0, gt=0, le=3600, description="seconds the supervisor of "
                                              "`--workers N` waits for a worker to answer its liveness ping "
                                              "(sent every half second) before it kills the worker as hung and "
                                              "starts another, logged at warning; uvicorn's 5 s killed busy "
                                              "workers on a loaded machine")
    log_level: str = Field("info", description="uvicorn log level")

    @field_validator("root")
    @classmethod
    def _root_is_dir(cls, v: Path | str) -> Path | str:
        if is_url(str(v)):
            return str(v).rstrip("/")
        v = Path(v).expanduser()
        if not v.is_dir():
            raise ValueError(f"root {v} is not a directory")
        return v.resolve()

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, v: SecretStr | None) -> SecretStr | None:
        return None if v is None or not v.get_secret_value() else v

    @property
    def state_dir(self) -> Path:
        """Service-owned files (stored manifests, default job output) live in ROOT/.reshard (for a root
        in a store: in ~/.cache/reshard/serve-HASH, or $XDG_CACHE_HOME)."""
        if isinstance(self.root, str):
            import hashlib

            from reshard.cachedir import cache_dir

            return cache_dir(f"serve-{hashlib.sha256(self.root.encode()).hexdigest()[:16]}")
        return self.root / ".reshard"

    @property
    def out_dir(self) -> Path:
        return (self.out.expanduser().resolve() if self.out is not None else self.state_dir / "out")

    @property
    def gathered_dir(self) -> Path:
        """Where copies of gathered pieces go (`reshard.service.transport.gathered`)."""
        return self.gather_dir.expanduser() if self.gather_dir is not None else self.state_dir / "gathered"

    @property
    def store_cache_path(self) -> Path:
        """Where the store cache's blocks go (`reshard.io.source.store_cache`)."""
        return self.store_cache_dir.expanduser() if self.store_cache_dir is not None else self.state_dir / "store-cache"

    @property
    def jobs_dir(self) -> Path:
        return self.state.expanduser().resolve() if self.state is not None else self.out_dir / STATE_DIR
