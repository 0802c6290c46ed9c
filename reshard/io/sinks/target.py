"""Where a write may go: never into its own source, never over the rank files of another layout unasked.

`reshard write ckpt --tp 4 -o shards/` into a `shards/` that holds tp=2 rank files would leave both sets
side by side (a merge refuses the mix later), and `-o ckpt` would write into the checkpoint being
read. Both are refused before anything is written, with one line naming the fix: a new folder, or
`--force`, which first removes the other layout's rank files (and the record that vouched for them).
A write of the same layout (resuming, or replacing the files of an older source) needs no force.
The same holds for a store prefix (`s3://...`), from its listing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from reshard.errors import OutputPathError, ReshardError
from reshard.format.checkpoint import MANIFEST_NAME
from reshard.format.rank_file import parse_rank_file_name
from reshard.io.sinks.writer import PARTIAL_NAME
from reshard.io.source.remote_dir import RemoteDirectory
from reshard.io.source.stores import RemotePath, is_url
from reshard.layout.mesh import Layout


def same_place(a: Any, b: Any) -> bool:
    """Whether two outputs or sources (paths or URLs) are the same directory or prefix."""
    if is_url(a) or is_url(b) or isinstance(a, RemotePath) or isinstance(b, RemotePath):
        return str(a).rstrip("/") == str(b).rstrip("/")
    pa, pb = Path(a), Path(b)
    pa, pb = (p.parent if p.suffix == ".safetensors" and p.is_file() else p for p in (pa, pb))
    return os.path.realpath(pa) == os.path.realpath(pb)


def check_not_source(out: str | os.PathLike[str], source_root: Any, *, command: str, shards: bool,
                     force: bool = False) -> None:
    """Refuse an output that is the source being read. Rank files in place of the rank files being read
    (`shards`) are refused whatever `force` says; rank files beside a checkpoint's weights only without it."""
    if not same_place(out, source_root) or (force and not shards):
        return
    if shards:
        raise OutputPathError(f"-o {out}: is the folder of the rank files being read; {command} into a new folder")
    raise OutputPathError(f"-o {out}: is the source checkpoint itself; {command} into a new folder (or add --force "
                          "to put the rank files beside its weights)")


def other_layout_files(out: str | os.PathLike[str], layout: Layout) -> tuple[list[str], str]:
    """(the rank files under `out` of another layout than `layout`, and the record and partial record that
    vouch for them; which layout they are of)."""
    names = _names(out)
    ranked = {n: parsed[1] for n in names if (parsed := parse_rank_file_name(n)) is not None}
    recorded = _recorded_layout(out) if MANIFEST_NAME in names else None
    if recorded is not None and recorded != layout and ranked:
        stale, theirs = sorted(ranked), recorded.describe()
    else:
        stale = sorted(n for n, world in ranked.items() if world != layout.world)
        worlds = sorted({ranked[n] for n in stale})
        theirs = f"world{'s' if len(worlds) > 1 else ''} of {', '.join(map(str, worlds))} ranks"
    if stale:
        stale += [n for n in (MANIFEST_NAME, PARTIAL_NAME) if n in names]
    return stale, theirs


def check_target(out: str | os.PathLike[str], layout: Layout, *, force: bool) -> list[str]:
    """Refuse (unless `force`) an output that holds rank files of another layout than `layout`; the
    names to remove first when `force`."""
    stale, theirs = other_layout_files(out, layout)
    if stale and not force:
        n = sum(parse_rank_file_name(s) is not None for s in stale)
        raise OutputPathError(f"-o {out}: holds {n} rank files of {theirs}, not {layout.describe()}; write into a "
                              "new folder, or add --force to replace them")
    return stale


def remove_names(out: str | os.PathLike[str], names: list[str]) -> None:
    """Delete `names` under the directory or store prefix `out` (what `check_target` said to remove)."""
    if is_url(out):
        d = RemoteDirectory(str(out))
        for name in names:
            d.store.delete(d.key(name))
        return
    for name in names:
        (Path(out) / name).unlink(missing_ok=True)


def _names(out: str | os.PathLike[str]) -> list[str]:
    if is_url(out):
        return RemoteDirectory(str(out)).names() or []
    p = Path(out)
    return sorted(e.name for e in os.scandir(p) if e.is_file()) if p.is_dir() else []


def _recorded_layout(out: str | os.PathLike[str]) -> Layout | None:
    """The layout `reshard.json` under `out` names (None when it names none or cannot be read)."""
    try:
        if is_url(out):
            text = RemoteDirectory(str(out)).read_bytes(MANIFEST_NAME)
        else:
            text = (Path(out) / MANIFEST_NAME).read_bytes()
        record = json.loads(text)
        sizes = record.get("layout") or {"tp": int(record["tp"])}
        return Layout.from_sizes(sizes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ReshardError):
        return None


__all__ = ["check_not_source", "check_target", "other_layout_files", "remove_names", "same_place"]
