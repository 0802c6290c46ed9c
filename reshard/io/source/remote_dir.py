"""A checkpoint directory in a store or on an HTTP server: the `reshard.format.checkpoint.Directory` of a URL;
`read_file` / `copy_beside` read a file beside a source, local or remote.

Headers come from one speculative ranged read per file (the first `SPECULATIVE` bytes; a second read
only for a longer header) and go through the same validation as local files. Where the size and
version of a file are `known` beforehand (the service's listing) and the node's store cache is on
(`reshard.io.source.store_cache`), those reads go through the cache like the stream's. JSON files are fetched
whole. Which files exist comes from a listing where the store can list (S3, GCS), else from
index.json / the usual names (plain HTTP, the Hub). A file whose version is a Last-Modified of the last
two seconds is read again once it is older (`reshard.io.source.stores.settled`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError
from reshard.format.checkpoint import FileInfo, TensorInfo, header_bytes_wanted, header_from
from reshard.format.meta_files import KEPT_NAMES
from reshard.io.outfs import atomic_file, copy_atomic
from reshard.io.source import store_cache
from reshard.io.source.stores import RemotePath, object_version, settled, store_for

SPECULATIVE = 128 << 10


class RemoteDirectory:
    """Files under one URL prefix; what it fetched is kept, so each file is asked for once."""

    def __init__(self, url: str, *, known: dict[str, tuple[int, str]] | None = None) -> None:
        self.root = RemotePath(url.rstrip("/"))
        self.known = known or {}  # file name -> (size, version), where a listing said so
        self.store, self.prefix = store_for(self.root.url + "/")
        self._json: dict[str, bytes | None] = {}
        self._heads: dict[str, tuple[bytes, dict[str, Any]] | None] = {}
        self._listing: tuple[list[str], dict[str, dict[str, Any]]] | None = None
        self.can_list = not self.root.url.lower().startswith(("http://", "https://", "hf://"))

    def path(self, name: str) -> RemotePath:
        return self.root / name

    def key(self, name: str) -> str:
        return f"{self.prefix.rstrip('/')}/{name}".lstrip("/")

    def listing(self) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """(sub-directory names, {file name: metadata}) where the store can list, else empty."""
        if self._listing is None:
            self._listing = self.store.list(self.prefix) if self.can_list else ([], {})
        return self._listing

    def names(self) -> list[str] | None:
        return sorted(self.listing()[1]) if self.can_list else None

    def is_file(self, name: str) -> bool:
        if self.can_list:
            return name in self.listing()[1]
        if name.endswith(".safetensors"):
            return self._head(name) is not None
        return self._fetch(name) is not None

    def read_bytes(self, name: str) -> bytes:
        data = self._fetch(name)
        if data is None:
            raise CheckpointError(f"{self.path(name)}: no such object")
        return data

    def _fetch(self, name: str) -> bytes | None:
        if name not in self._json:
            self._json[name] = self.store.read_all(self.key(name))
        return self._json[name]

    def _head(self, name: str) -> tuple[bytes, dict[str, Any]] | None:
        """The first SPECULATIVE bytes of a file and its metadata (None if it does not exist)."""
        if name not in self._heads:
            if name in self.known and store_cache.current() is not None:
                size, version = self.known[name]
                self._heads[name] = (self._read(name, 0, min(SPECULATIVE, size)), {"size": size, "e_tag": version})
                return self._heads[name]
            try:
                data, meta = settled(lambda: self.store.get(self.key(name), 0, SPECULATIVE), where=self.path(name).url)
                self._heads[name] = (bytes(data), meta)
            except CheckpointError:  # no such object
                self._heads[name] = None
        return self._heads[name]

    def _read(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file whose size and version are known, through the store cache if on."""
        size, version = self.known[name]

        def get(lo: int, hi: int) -> memoryview:
            return self.store.get(self.key(name), lo, hi, version=version)[0]

        cache = store_cache.current()
        if cache is None:
            return bytes(get(start, end))
        return bytes(cache.read(lambda lo, hi: (get(lo, hi),), self.path(name).url, version, size, start, end))

    def header(self, name: str) -> tuple[FileInfo, dict[str, TensorInfo]]:
        hit = self._head(name)
        if hit is None:
            raise CheckpointError(f"{self.path(name)}: no such object")
        head, meta = hit
        size, version = int(meta["size"]), object_version(meta, where=self.path(name).url)
        if len(head) >= 8 and header_bytes_wanted(head, size) > len(head):
            if name in self.known:
                head += self._read(name, len(head), header_bytes_wanted(head, size))
            else:
                rest, _ = self.store.get(self.key(name), len(head), header_bytes_wanted(head, size), version=version)
                head += bytes(rest)
        return header_from(self.path(name), head, size=size, version=version)

    def stat_files(self, names: tuple[str, ...]) -> dict[str, tuple[int, str]]:
        """{file name: (size, version)} of the files directly under the prefix: from the listing
        where the store lists, else from a 1-byte ranged GET of each of `names` and of the files
        index.json names (plain HTTP)."""
        if self.can_list:
            return {n: (int(m["size"]), object_version(m, where=self.path(n).url)) for n, m in self.listing()[1].items()}
        wanted = set(names)
        index = self._fetch("model.safetensors.index.json")
        if index is not None:
            try:
                wanted |= set(json.loads(index).get("weight_map", {}).values())
            except (ValueError, AttributeError):
                pass  # Checkpoint.from_directory says what is wrong with it
        out = {}
        for name in sorted(wanted):
            try:
                _, meta = settled(lambda n=name: self.store.get(self.key(n), 0, 1), where=self.path(name).url)
            except CheckpointError:  # no such object
                continue
            out[name] = (int(meta["size"]), object_version(meta, where=self.path(name).url))
        return out

    def exists(self) -> bool:
        """Whether anything is under the prefix (stores that list) or a known checkpoint file answers."""
        if self.can_list:
            dirs, files = self.listing()
            return bool(dirs or files)
        return any(self.is_file(n) for n in ("model.safetensors.index.json", "model.safetensors"))


def read_file(root: Path | RemotePath, name: str) -> bytes:
    """File `name` beside a source's files (config.json), local or remote."""
    if isinstance(root, RemotePath):
        return RemoteDirectory(root.url).read_bytes(name)
    return (Path(root) / name).read_bytes()


def meta_files_at(root: Path | RemotePath) -> list[str]:
    """Which of a checkpoint's small files other than the training state (config.json, generation config,
    tokenizer files: `reshard.format.meta_files.KEPT_NAMES`) are beside a source, local or remote."""
    if not isinstance(root, RemotePath):
        return [n for n in KEPT_NAMES if (Path(root) / n).is_file()]
    d = RemoteDirectory(root.url)
    return [n for n in KEPT_NAMES if d.is_file(n)]


def copy_meta_files(root: Path | RemotePath, dest: Path) -> list[str]:
    """Copy a source's small files (`meta_files_at`) into the local directory `dest`, each atomically;
    their names."""
    names = meta_files_at(root)
    for name in names:
        copy_beside(root, name, dest / name)
    return names


def copy_beside(root: Path | RemotePath, name: str, dest: Path) -> None:
    """Copy file `name` of a source (local or remote) to the local `dest`, atomically."""
    if not isinstance(root, RemotePath):
        copy_atomic(Path(root) / name, dest)
        return
    with atomic_file(dest) as f:
        f.write(read_file(root, name))
