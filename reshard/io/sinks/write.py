"""The one write path: rank files of a plan into a directory or a store, whoever asks.

`reshard write`, the public `reshard.write_shards` and the service's write jobs all call
`write_shards`, passing only what differs between them (a progress bar, a byte counter that can
cancel). What a write is, beyond the bytes, is decided here once:

- the sink, from `out`: a store URL (`s3://BUCKET/PREFIX`, ...) is written by
  `reshard.io.sinks.store_writer` as multipart uploads, anything else is a local directory written
  by `reshard.io.sinks.writer` (atomic files, resumable, the writer pool);
- the mapped reads: row-split runs are gathered from leased mappings of the source files while the
  write runs, when the calling thread can switch them on (`reshard.io.source.mapped_files`);
- the verified identities: each local rank file written is recorded with its sha256
  (`reshard.io.verified`), so a later fill trusts it while it stays unchanged instead of hashing it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from reshard.format.checkpoint import Source
from reshard.io.sinks.store_writer import write_to_store
from reshard.io.sinks.target import check_not_source, check_target, remove_names
from reshard.io.sinks.writer import write_to_dir
from reshard.io.source.mapped_files import MAPS
from reshard.io.source.rank_dir import ShardSet
from reshard.io.source.schemes import check_scheme
from reshard.io.source.stores import is_url
from reshard.io.verified import record_written
from reshard.plan.types import Plan


def write_shards(
    ckpt: Source, plan: Plan, out: str | os.PathLike[str], *, progress: bool | None = None,
    on_bytes: Callable[[int], None] | None = None, writers: int | None = None, force: bool = False,
) -> dict[str, Any]:
    """Write every rank in `plan` to `out`, then `reshard.json`; returns the record it wrote.

    `out` is a local directory (see `reshard.io.sinks.writer.write_to_dir`: atomic, resumable,
    `writers` files at once; the record also lists the ranks `kept` and `written`) or a store prefix
    such as `s3://BUCKET/PREFIX` (`reshard.io.sinks.store_writer.write_to_store`; `writers` does not
    apply). `progress` shows a bar (None: when stderr is a terminal); `on_bytes` is called with each
    piece written, from the writing threads, one call at a time; what it raises stops the write.

    Called from the main thread, this switches on mapped reads for the write (a SIGIO handler and a
    keeper thread are installed once per process; mappings are dropped when the write ends unless
    the process had them on); from another thread the process's own choice holds (a server worker's
    `mapped_reads` setting). Local rank files are then recorded as verified.

    Refused before anything is written (`reshard.io.sinks.target`): an `out` that is the source itself,
    or that holds rank files of another layout; with `force`, those are removed first, and rank files
    may go beside a checkpoint's own weights.
    """
    check_scheme(out)
    check_not_source(out, ckpt.root, command="write", shards=isinstance(ckpt, ShardSet), force=force)
    stale = check_target(out, plan.layout, force=force)
    if stale:
        remove_names(out, stale)
    if is_url(out):
        with _mapped_reads():
            return write_to_store(ckpt, plan, str(out), progress=progress, on_bytes=on_bytes)
    with _mapped_reads():
        record = write_to_dir(ckpt, plan, out, progress=progress, on_bytes=on_bytes, writers=writers)
    record_written(out, record["files"])  # a fill trusts these files' sha256 while they stay unchanged
    return record


@contextlib.contextmanager
def _mapped_reads() -> Iterator[None]:
    """Mapped reads on for the block where this thread may switch them on (only the main thread may
    install the signal handler they need), else as the process has them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with MAPS.enabled_while():
        yield


__all__ = ["write_shards"]
