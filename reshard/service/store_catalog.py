"""The catalog of a root in a store (`reshard serve --root s3://BUCKET/PREFIX`): each sub-prefix is a checkpoint.

Same answers as the local `Catalog`: one listing per request stands in for the `scandir` (object name,
size and ETag make the cache key, so a replaced object is re-parsed and shard ETags stay strong),
headers come from ranged reads, and names are validated before they become keys. A plain HTTP root
cannot be listed: `GET /v1/checkpoints` is empty there, and a checkpoint's files are found through
its index.json (a 1-byte ranged GET of each gives its size and ETag). Uploads need a local root.
"""

from __future__ import annotations

from typing import Any

from reshard.errors import NotFoundError
from reshard.format.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, Checkpoint
from reshard.format.dcp_metadata import METADATA_NAME
from reshard.io.source.dcp_dir import DcpCheckpoint, dcp_kind
from reshard.io.source.remote_dir import RemoteDirectory
from reshard.io.source.stores import RemotePath, store_for
from reshard.rules.from_config import RULES_FILES
from reshard.service.catalog import _WEIGHTS, Catalog, Served, StatKey, check_name, valid_name, watched
from reshard.service.http_errors import BadRequest
from reshard.service.serve_settings import Settings

_PROBED = (INDEX_NAME, SINGLE_NAME, CONFIG_NAME, METADATA_NAME, *RULES_FILES)  # what a root that cannot list is asked for


class StoreCatalog(Catalog):
    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.root = RemotePath(str(settings.root))  # type: ignore[assignment]
        self.store, self.prefix = store_for(self.root.url + "/")

    def directory(self, name: str, *, create: bool = False) -> Any:
        check_name(name)
        if create:
            raise BadRequest("uploads need a local --root; this server's root is in a store")
        return self.root / name

    def scan(self, directory: Any) -> StatKey:
        files = RemoteDirectory(directory.url).stat_files(_PROBED)
        key = tuple(sorted((n, size, version, 0) for n, (size, version) in files.items()
                           if watched(n)))
        if not key:
            raise NotFoundError(f"no checkpoint named {directory.name!r}; GET /v1/checkpoints lists them")
        return key  # type: ignore[return-value]

    def names(self) -> list[dict[str, Any]]:
        if not RemoteDirectory(self.root.url).can_list:
            return []  # a plain HTTP root cannot be listed: checkpoints are asked for by name
        dirs, _ = self.store.list(self.prefix)
        found = []
        for name in sorted(dirs):
            if not valid_name(name):
                continue
            try:
                key = self.scan(self.root / name)
            except NotFoundError:
                continue
            weights = [f for f in key if f[0].endswith(_WEIGHTS)]
            if weights:
                found.append({"name": name, "files": len(weights), "bytes": sum(f[1] for f in weights)})
        return found

    def _open_checkpoint(self, name: str, directory: Any, key: StatKey) -> Served:
        # the listing's sizes and versions: headers are read through the node's store cache, if on
        d = RemoteDirectory(directory.url, known={f[0]: (f[1], f[2]) for f in key})
        if dcp_kind(d, [f[0] for f in key] if d.can_list else None):
            return DcpCheckpoint.open(d)
        return Checkpoint.from_directory(d)
