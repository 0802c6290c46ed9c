"""A rank's shard as a byte stream: from a shard directory, one rank file, or the service's URL.

`open_rank_stream` is how `fill_model` and the trainer reach their bytes; a URL is pulled from the
service (only this rank's shard), a directory's rank file is read; both straight into the caller's
buffers (`reshard.io.client.body`). `open_cut_stream` also takes a directory of another layout (or an
HF checkpoint) and cuts the rank's bytes from it as they are read (`open_relaid_stream`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.checkpoint import CONFIG_NAME, MANIFEST_NAME
from reshard.format.rank_file import decode_metadata, parse_rank_file_name, rank_file_name
from reshard.io.client.body import ShardBody, file_body, get_json
from reshard.io.client.shard_prefetch import take as take_prefetched
from reshard.io.client.wire import checkpoint_url, redact
from reshard.io.source.schemes import check_scheme
from reshard.io.source.stores import is_url
from reshard.layout.mesh import Layout


def open_rank_stream(
    source: str | Path, rank: int, layout: Layout | int, *, token: str | None = None, need_config: bool = True,
    rules: str | None = None, engine: str | None = None,
) -> tuple[dict[str, Any] | None, Iterator[Any], str | None, str]:
    """(config, byte chunks of this rank's file, expected sha256 or None, a name for errors).

    `source` is a shard directory, the service's checkpoint URL, or one rank file (whose own header
    says its rank and layout); `layout` a `Layout` or tp alone. The config is None only when absent and
    `need_config` is false; it is not fetched from a URL unless needed. `rules` (a stored label) and
    `engine` choose the service's cut."""
    layout = layout if isinstance(layout, Layout) else Layout(tp=layout)
    check_scheme(source)
    if is_url(source):
        config = None
        if need_config:
            params = {k: v for k, v in (("rules", rules), ("engine", engine)) if v}
            config = get_json(checkpoint_url(str(source)), params=params, token=token).get("config")
            if not isinstance(config, dict):
                config = _no_config(f"{redact(str(source))}: the checkpoint has no config.json", need_config)
        want = layout.tp if layout.tp_only else layout
        body = (None if rules or engine else take_prefetched(str(source), rank, want)) or ShardBody(
            str(source), rank, want, token=token, rules=rules, engine=engine)
        return config, body, None, body.name
    path = Path(source)
    root = path.parent if path.is_file() else path
    if not path.is_file():
        path = root / rank_file_name(rank, layout.world)
    if not root.is_dir():
        raise CheckpointError(f"{source}: no such directory or rank file; give a directory of rank files (`reshard "
                              "write` makes one), a rank file, or the service's http://HOST:PORT/v1/checkpoints/NAME")
    if not path.is_file():
        have = sorted({named[1] for p in root.iterdir() if (named := parse_rank_file_name(p.name))})
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in layout.given().items())
        here = f"the rank files here are of worlds of {have} ranks" if have else "there are no rank files here"
        raise CheckpointError(f"{root}: no {path.name} for {layout.describe()} ({here}); run `reshard write {root} "
                              f"{flags} -o DIR` and give DIR")
    config = json.loads((root / CONFIG_NAME).read_text()) if (root / CONFIG_NAME).is_file() \
        else _no_config(f"{root}: no config.json beside the rank files", need_config)
    sha = None
    if (root / MANIFEST_NAME).is_file():
        sha = json.loads((root / MANIFEST_NAME).read_text()).get("files", {}).get(path.name, {}).get("sha256")
    return config, file_body(path, sha256=sha), sha, str(path)


def open_relaid_stream(
    directory: str | Path, rank: int, layout: Layout | int, *, token: str | None = None, need_config: bool = True,
) -> tuple[dict[str, Any] | None, Iterator[Any], str]:
    """(config, byte chunks, a name for errors) of rank `rank` of `layout` cut on the fly from a directory
    of rank files of any other layout: the bytes `reshard write DIRECTORY ... -o OUT` would put in that
    rank's file, planned from the files' self-description; only this rank's slices are read. From the
    service's URL of such a directory, the service cuts it (the same bytes, checked against its sha256)."""
    from reshard.io.rank_stream import RankStream
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    layout = layout if isinstance(layout, Layout) else Layout(tp=layout)
    if is_url(directory):
        config, body, _, name = open_rank_stream(directory, rank, layout, token=token, need_config=need_config)
        return config, body, name
    source, manifest = open_source(directory)
    plan = make_plan(source, manifest, layout, ranks=[rank])
    root = Path(directory)
    config = json.loads((root / CONFIG_NAME).read_text()) if (root / CONFIG_NAME).is_file() \
        else _no_config(f"{root}: no config.json beside the rank files", need_config)
    return config, _closing(RankStream(plan.ranks[0])), f"{root} (rank {rank} of {layout.describe()}, cut as read)"


def open_cut_stream(
    source: str | Path, rank: int, layout: Layout | int, *, token: str | None = None, need_config: bool = True,
) -> tuple[dict[str, Any] | None, Iterator[Any], str | None, str]:
    """As `open_rank_stream` (config, chunks, expected sha256 or None, a name) when `source` is a URL (the
    service cuts any layout) or a directory holding `layout`'s rank files; else rank `rank`'s bytes cut on
    the fly from what the directory holds (rank files of another layout, an HF checkpoint)."""
    layout = layout if isinstance(layout, Layout) else Layout(tp=layout)
    if is_url(source) or Path(source).is_file() or holds_layout(Path(source), layout):
        return open_rank_stream(source, rank, layout, token=token, need_config=need_config)
    config, chunks, name = open_relaid_stream(source, rank, layout, token=token, need_config=need_config)
    return config, chunks, None, name


def holds_layout(directory: Path, layout: Layout) -> bool:
    """Whether `directory` holds the rank files of `layout` (its first file says so in its metadata)."""
    from safetensors import safe_open

    from reshard.layout.placement import describe_layout

    first = directory / rank_file_name(0, layout.world)
    if not first.is_file():
        return False
    with safe_open(first, "pt") as f:
        meta = f.metadata() or {}
    return describe_layout(decode_metadata(meta, str(first)), str(first)) == layout


def _closing(stream: Any) -> Iterator[memoryview]:
    with stream:
        yield from stream.chunks()


def _no_config(what: str, need_config: bool) -> None:
    if need_config:
        raise CheckpointError(f"{what}; the trainer needs one")
