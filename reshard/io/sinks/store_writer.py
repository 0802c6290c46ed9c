"""`reshard write SRC --tp N -o s3://BUCKET/OUT`: rank files streamed into a store as multipart uploads
(the store sink of the one write path, `reshard.io.sinks.write.write_shards`).

Each rank file is one multipart upload fed by its `RankStream` chunk by chunk (memory: a few parts,
never a file); S3 makes an object visible only when its upload completes, so an interrupted write
leaves nothing under a final rank name (the upload is aborted). `reshard.json`, which vouches for
the set, is deleted first when it belongs to another plan and written last, after every rank file
and config.json: a reader never sees a record claiming files that are not all there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from reshard.format.checkpoint import Source
from reshard.format.rank_file import rank_file_name
from reshard.io.progress import Progress
from reshard.io.rank_stream import CHUNK, RankStream
from reshard.io.sinks.writer import MANIFEST_NAME, complete_record, record_of_plan
from reshard.io.source.remote_dir import meta_files_at, read_file
from reshard.io.source.stores import store_for
from reshard.plan.types import Plan, RankPlan

PART = 8 << 20  # multipart part size (S3 needs >= 5 MiB for all parts but the last)
UPLOADS_IN_FLIGHT = 4


def _rank_body(plan: RankPlan, sha: Any, on_bytes: Callable[[int], None]) -> Iterator[memoryview]:
    with RankStream(plan, chunk_size=CHUNK) as stream:
        for chunk in stream.chunks():  # each chunk owns its memory: the uploader may still hold it
            sha.update(chunk)
            on_bytes(len(chunk))
            yield chunk


def write_to_store(ckpt: Source, plan: Plan, out_url: str, *, progress: bool | None = None,
                          on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write every rank in `plan` under the store prefix `out_url`, then config.json, then reshard.json."""
    store, prefix = store_for(out_url.rstrip("/") + "/")

    def key(name: str) -> str:
        return f"{prefix.rstrip('/')}/{name}".lstrip("/")

    bar = Progress(sum(r.size for r in plan.ranks), "write", enabled=progress)
    previous = store.read_all(key(MANIFEST_NAME))
    record = record_of_plan(previous, plan.digest)
    if previous is not None and not record["files"]:
        store.delete(key(MANIFEST_NAME))  # it would vouch for rank files this run replaces

    def done(n: int) -> None:
        bar.update(n)
        if on_bytes is not None:
            on_bytes(n)

    for rp in plan.ranks:
        name = rank_file_name(rp.rank, rp.world)
        sha = hashlib.sha256()
        store.put(key(name), _rank_body(rp, sha, done), chunk_size=PART, concurrency=UPLOADS_IN_FLIGHT)
        record["files"][name] = {"rank": rp.rank, "size": rp.size, "sha256": sha.hexdigest()}
    bar.close()
    for name in meta_files_at(ckpt.root):  # config.json, generation config, tokenizer: what the source has
        store.put(key(name), read_file(ckpt.root, name))
    record = complete_record(record, ckpt, plan)
    store.put(key(MANIFEST_NAME), (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return record
