"""The library's settings: `RESHARD_*` environment variables, read when they are used.

Every knob the library (not the service: `reshard.service.serve_settings`) reads from the environment is a
field here, so the list of them is one class (docs/service.md generates its table from both). They
are read at each use, not at import, so a process may change them between calls.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from reshard.errors import ReshardError


class LibrarySettings(BaseSettings):
    """Library settings; each field is `RESHARD_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="RESHARD_", extra="ignore")

    plan_source: str = Field("table", description="TP plans: `table` (the shipped table, whatever transformers is "
                             "installed), `live` (the installed transformers), `auto` (the installed one when its "
                             "version differs from the table's; read in reshard.rules.tp_plans without this class, so that a "
                             "command's start-up does not import pydantic-settings)")
    mla: str = Field("", description="`heads`: split DeepSeek-style MLA attention by heads (transformers replicates it)")
    store_inflight: int = Field(64 << 20, ge=1, description="bytes a store-backed stream fetches ahead of its reader")
    store_concurrency: int = Field(16, ge=1, description="store requests in flight, all streams of a process together")
    store_max_gap: int = Field(256 << 10, ge=0, description="the longest gap between two ranges fetched as one request")
    store_waste: float = Field(0.04, ge=0, description="gap bytes fetched to save requests, as a share of the bytes read")
    store_multirange: bool = Field(True, description="ask an HTTP(S) store that answers several byte ranges in one "
                                   "request (multipart/byteranges: nginx, Caddy) for a row-split tensor's slices "
                                   "exactly, not for the row blocks that cover them")
    store_range_gap: int = Field(256, ge=0, description="in a request of several ranges, the longest gap "
                                 "between two ranges fetched as one (a part costs ~100 bytes of headers)")
    store_ranges: int = Field(256, ge=2, le=1024, description="the most byte ranges asked for in one request "
                              "(halved for a server that answers fewer: Starlette takes 100, Apache 200; 256 ranges "
                              "fit nginx's 8 KiB header line)")
    store_rows: Literal["auto", "blocks", "slices"] = Field(
        "auto", description="how a row-split tensor's rows are fetched from a store: `auto`, whichever costs less by "
        "the store's measured costs (reshard.io.source.readcost); `blocks`, the row block that covers them (one request for "
        "many rows, up to tp times the bytes); `slices`, each row's slice (several per request where the server "
        "answers several ranges, else one request each)")
    store_bandwidth: float = Field(0.0, ge=0, description="bytes per second a node gets from the store, for pricing "
                                   "reads (reshard.io.source.readcost); 0: measured from the process's own requests")
    store_request_cost: float = Field(0.0, ge=0, description="seconds one store request costs, for pricing reads "
                                      "(reshard.io.source.readcost); 0: measured from the process's own requests")
    store_retries: int = Field(5, ge=0, description="retries of a failed store request")
    store_timeout: float = Field(60.0, gt=0, description="seconds a store request may take")
    verified_dir: str = Field("", description="where the identities of rank files whose sha256 was verified are "
                              "recorded (reshard.io.verified; read there without this class: the fill path does "
                              "not import pydantic-settings); default `$XDG_CACHE_HOME/reshard/verified`, "
                              "`~/.cache/reshard/verified`")
    import_cache_dir: str = Field("", description="where a process that imported reshard keeps transformers' import "
                                  "structure, so that importing transformers does not read its whole source tree "
                                  "(reshard.importcache, read there without this class); default "
                                  "`$XDG_CACHE_HOME/reshard/imports`, `~/.cache/reshard/imports`")


def library_settings() -> LibrarySettings:
    """The settings as the environment says now; a bad value is one `ReshardError` naming the variable."""
    try:
        return LibrarySettings()
    except ValidationError as e:
        err = e.errors()[0]
        name = "RESHARD_" + str(err["loc"][0]).upper() if err["loc"] else "RESHARD_*"
        raise ReshardError(f"{name}: {err['msg']} (environment variable)") from None
