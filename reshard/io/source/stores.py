"""Checkpoints in object stores and on HTTP servers, read through obstore (Rust `object_store`).

URLs: `s3://BUCKET/PREFIX` (endpoint, region and keys from the standard `AWS_*` variables; profiles
and config files through boto3 when it is installed), `gs://BUCKET/PREFIX` (`GOOGLE_*` variables),
`http(s)://HOST/PATH/` (any static server that answers Range), `hf://ORG/MODEL[@REVISION]` (the Hub's
`resolve/` URLs). One client per store root and configuration; retries with backoff on timeouts,
dropped connections and 5xx are obstore's (`RetryConfig`). Every failure becomes one `ReshardError`
line naming the object, never a credential.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from reshard.errors import (
    CheckpointError,
    ReshardError,
    SourceChangedError,
    StoreError,
    StoreUnavailableError,
)
from reshard.io.retry import Backoff
from reshard.io.source.readcost import costs_for
from reshard.settings import library_settings

URL_RE = re.compile(r"^(s3|gs|hf|https?)://", re.I)
CHUNK = 1 << 20  # bytes per piece of a streamed body (`Store.get_chunks`)
SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_SERVICE_ACCOUNT_KEY",
               "HF_TOKEN")
_CONFIG_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
                "AWS_ALLOW_HTTP", "AWS_SKIP_SIGNATURE", *SECRET_VARS, "GOOGLE_APPLICATION_CREDENTIALS")


def is_url(spec: Any) -> bool:
    """Whether `spec` names a remote checkpoint (s3://, gs://, hf://, http(s)://) rather than a path."""
    return isinstance(spec, str) and bool(URL_RE.match(spec))


@dataclass(frozen=True)
class RemotePath:
    """A file or prefix in a store, as a URL; quacks like the few `Path` members reshard uses."""

    url: str

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rstrip("/").rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url.rstrip('/')}/{name}")

    def __str__(self) -> str:
        return self.url


def scrub(text: str) -> str:
    """`text` without any credential this process knows of (error messages and logs)."""
    for var in SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return re.sub(r"(?i)(signature|credential|x-amz-security-token|authorization)[=:]\s*[^\s&,;]+", r"\1=***", text)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return scrub(text[0] if text else type(e).__name__)[:300]


class Store:
    """One obstore client for a store root (`s3://BUCKET`, `gs://BUCKET`, `http(s)://HOST`)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "") \
            if root.startswith("s3://") else ""
        self._store = _make_store(root, self.endpoint)
        self.costs = costs_for(root)

    def get(self, key: str, start: int, end: int, *, version: str | None = None) -> tuple[memoryview, dict[str, Any]]:
        """Bytes [start, end) of object `key` (fewer at its end) and its metadata; with `version`,
        an object that is no longer that version raises `SourceChangedError`."""
        try:
            with self.costs.timed() as got:  # what requests cost, for choosing how to read (reshard.io.source.readcost)
                result = self._request(key, start, end, version)
                data = _collect(result)
                got.append(len(data))
        except Exception as e:
            raise self.error(e, key) from None
        count_fetched(len(data))
        self._check_version(result.meta, key, version)
        return data, result.meta

    def get_chunks(self, key: str, start: int, end: int, *, version: str | None = None) -> Iterator[memoryview]:
        """`get`'s bytes as they arrive, in pieces of about `CHUNK` bytes (the version checked before the
        first): for a body that goes on to a file."""
        n = 0
        try:
            with self.costs.timed() as got:
                result = self._request(key, start, end, version)
                self._check_version(result.meta, key, version)
                for view in _pieces(result):
                    n += len(view)
                    count_fetched(len(view))
                    yield view
                got.append(n)
        except ReshardError:
            raise
        except Exception as e:
            raise self.error(e, key) from None

    def _request(self, key: str, start: int, end: int, version: str | None) -> Any:
        """The GET of bytes [start, end) of `key`, conditional on `version` (its body not read yet)."""
        import obstore

        options: dict[str, Any] = {"range": (start, end)}
        if version is not None and not version.startswith("mtime:"):
            options["if_match"] = version
        return obstore.get(self._store, key, options=options)

    def _check_version(self, meta: dict[str, Any], key: str, version: str | None) -> None:
        if version is not None and (now := object_version(meta, where=self.url(key))) != version:
            raise SourceChangedError(f"{self.url(key)}: replaced while being read (ETag {now}, "
                                     f"planned {version}); re-plan and retry")

    def read_all(self, key: str) -> bytes | None:
        """The whole object, or None where it does not exist."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            data = bytes(obstore.get(self._store, key).bytes())
            count_fetched(len(data))
            return data
        except (NotFoundError, FileNotFoundError):
            return None
        except Exception as e:
            raise self.error(e, key) from None

    def list(self, prefix: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """(sub-prefix names, {file name: metadata}) directly under `prefix`."""
        import obstore

        try:
            res = obstore.list_with_delimiter(self._store, prefix.strip("/") or None)
        except Exception as e:
            raise self.error(e, prefix) from None
        dirs = [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]
        files = {m["path"].rsplit("/", 1)[-1]: m for m in res["objects"]}
        return dirs, files

    def put(self, key: str, data: Any, *, chunk_size: int = 8 << 20, concurrency: int = 4) -> None:
        """Upload `data` (bytes, or an iterable of buffers: a multipart upload, never buffered
        whole); the object appears under `key` only once complete."""
        import obstore

        failed: list[BaseException] = []

        def body() -> Iterator[Any]:  # what the data's producer raised is raised as it was
            try:
                yield from data
            except BaseException as e:
                failed.append(e)
                raise

        whole = isinstance(data, (bytes, bytearray))
        try:
            obstore.put(self._store, key, data if whole else body(), chunk_size=chunk_size,
                        max_concurrency=concurrency, use_multipart=not whole)
        except BaseException as e:
            if failed:
                raise failed[0] from None
            if not isinstance(e, Exception):
                raise
            raise self.error(e, key) from None

    def delete(self, key: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.delete(self._store, key)
        except (NotFoundError, FileNotFoundError):
            pass
        except Exception as e:
            raise self.error(e, key) from None

    def url(self, key: str) -> str:
        return f"{self.root}/{key}"

    def error(self, e: BaseException, key: str) -> Exception:
        """One clear line for an obstore failure on `key`."""
        from obstore import exceptions as ox

        where = self.url(key)
        text = _first_line(e)
        full = scrub(str(e))
        if isinstance(e, ox.PreconditionError):
            return SourceChangedError(f"{where}: replaced while being read; re-plan and retry")
        if "169.254.169.254" in full or "fd00:ec2::254" in full:
            return StoreError(f"{where}: no AWS credentials found (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                              "a profile, or instance metadata); set them, or AWS_SKIP_SIGNATURE=true for a public bucket")
        if "NoSuchBucket" in full or "bucket does not exist" in full.lower():
            return StoreError(f"{where}: no such bucket {self.root.split('://', 1)[1]!r} at "
                              f"{self.endpoint or 'the default endpoint'}; check the URL and AWS_ENDPOINT_URL")
        if isinstance(e, (ox.NotFoundError, FileNotFoundError)):
            return CheckpointError(f"{where}: no such object")
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or re.search(
                r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|Forbidden|status code: 403\b", full):
            return StoreError(f"{where}: access denied ({_code(full) or text}); check the credentials "
                              "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile) and the bucket policy")
        status = re.search(r"status code: (\d{3})", full)
        if status:
            return StoreError(f"{where}: the server answered {status.group(1)} after retries ({text})")
        if re.search(r"(?i)error sending request|connect|dns|timed out|connection refused|unreachable", full):
            return StoreUnavailableError(f"{where}: cannot reach {self.endpoint or self.root} after retries "
                                         f"({_cause(full) or text})")
        return StoreError(f"{where}: {text}")


def _collect(result: Any) -> memoryview:
    """A GET's body, copied piece by piece (`CHUNK` bytes) into one buffer of its length. Copying out
    of obstore's own buffer of a large body (`bytes()`) costs two to three times the CPU: measured on
    8 MiB blocks, 1.5-2.3 CPU-seconds per GB against 0.8-0.9 for the pieces (fresh pages each time)."""
    lo, hi = result.range
    out, n = memoryview(bytearray(hi - lo)), 0
    for view in _pieces(result):
        out[n : n + len(view)] = view
        n += len(view)
    return out[:n]


def _pieces(result: Any) -> Iterator[memoryview]:
    """A GET's body as it arrives, in pieces of about `CHUNK` bytes."""
    for piece in result.stream(min_chunk_size=CHUNK):
        yield memoryview(piece)


def _code(text: str) -> str | None:
    m = re.search(r"<Code>([^<]+)</Code>", text)
    return m.group(1) if m else None


def _cause(text: str) -> str | None:
    m = re.search(r"(?i)(connection refused|timed out|dns error[^,)]*|connection reset)", text)
    return m.group(1) if m else None


def object_version(meta: dict[str, Any], *, where: str | None = None) -> str:
    """What identifies one version of an object: its ETag, else its version id, else its mtime (taken
    once it is `SETTLE` seconds old: see `settled`).

    A server that sends none of them (obstore then reports the Unix epoch as the mtime) is refused
    with a `StoreError`: a file rewritten there while it is read could not be told from the one
    planned, and a rank file would mix the bytes of two versions."""
    if meta.get("e_tag"):
        return str(meta["e_tag"])
    if meta.get("version"):
        return f"version:{meta['version']}"
    modified = meta.get("last_modified")
    if isinstance(modified, datetime.datetime) and modified.timestamp() > 0:
        return f"mtime:{modified.isoformat()}"
    raise StoreError(f"{where or meta.get('path')}: the server sends no ETag and no Last-Modified, so a change to "
                     "the file while it is read could not be detected; serve it with a server that sends ETag or "
                     "Last-Modified (nginx, caddy, an object store), or copy the checkpoint to a local directory")


SETTLE = 2.0  # seconds a Last-Modified must be old before it identifies a version (see `settled`)
_SETTLE_TRIES = 3
T = TypeVar("T")


def settled(get: Callable[[], tuple[T, dict[str, Any]]], *, where: str) -> tuple[T, dict[str, Any]]:
    """`get()` (data of an object and its metadata), taken when its version can be trusted.

    Last-Modified has whole seconds: a file rewritten within the second it was last written keeps
    it, so a version read in that second could be followed by other bytes under the same version
    (a rank file of two versions). An object whose only validator is a Last-Modified less than
    `SETTLE` seconds old (by this machine's clock: a server's clock within a second of it) is read
    again once it is that old; from then on, any rewrite gives it another Last-Modified, which every
    later read compares. One that is still that new after three reads is refused."""
    for _ in range(_SETTLE_TRIES):
        data, meta = get()
        wait = _settling(meta)
        if wait <= 0:
            return data, meta
        time.sleep(min(wait, SETTLE))
    raise SourceChangedError(f"{where}: modified within {SETTLE:g} s of each of {_SETTLE_TRIES} reads (Last-Modified "
                             f"{meta['last_modified'].isoformat()}, the server's only validator); retry once it is "
                             "no longer being written, or serve it with ETags")


def _settling(meta: dict[str, Any]) -> float:
    """Seconds until the version in `meta` can be trusted (<= 0: now)."""
    modified = meta.get("last_modified")
    if meta.get("e_tag") or meta.get("version") or not isinstance(modified, datetime.datetime):
        return 0.0
    return modified.timestamp() + SETTLE - time.time() if modified.timestamp() > 0 else 0.0


def store_backoff(retries: int) -> Backoff:
    """How store requests are retried (`RESHARD_STORE_RETRIES`): by obstore, and by `MultiRangeClient`."""
    return Backoff(retries, first=0.1, cap=5.0)


def _make_store(root: str, endpoint: str) -> Any:
    from obstore.store import GCSStore, HTTPStore, S3Store

    settings = library_settings()
    timeout = settings.store_timeout
    retry = store_backoff(settings.store_retries).obstore_config(retry_timeout=max(timeout, 1) * 2)
    client = {"timeout": datetime.timedelta(seconds=timeout), "connect_timeout": datetime.timedelta(seconds=10),
              "allow_http": endpoint.startswith("http://") or root.startswith("http://")
              or os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true"}
    scheme, rest = root.split("://", 1)
    if scheme == "s3":
        kwargs: dict[str, Any] = {}
        if endpoint:
            kwargs["endpoint"] = endpoint
            kwargs["virtual_hosted_style_request"] = False
        provider = None
        if not os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SKIP_SIGNATURE", "").lower() != "true":
            provider = _boto3_provider()
        return S3Store(rest, client_options=client, retry_config=retry, credential_provider=provider, **kwargs)
    if scheme == "gs":
        return GCSStore(rest, client_options=client, retry_config=retry)
    return HTTPStore.from_url(root, client_options=client, retry_config=retry)


def _boto3_provider() -> Any:
    """Credentials from AWS profiles and config files, when boto3 is installed (else obstore's own
    environment and instance-metadata chain)."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    session = boto3.Session()
    if session.get_credentials() is None:  # boto3 walked the whole chain (env, profiles, metadata): nothing
        raise StoreError("no AWS credentials found (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, or "
                         "instance metadata); set them, or AWS_SKIP_SIGNATURE=true for a public bucket")
    return Boto3CredentialProvider(session)


FETCH_HOOKS: list[Callable[[int], None]] = []  # called with the body bytes of every GET (the service counts them)


def count_fetched(n: int) -> None:
    """`n` more bytes came from a store: tell whoever counts (`FETCH_HOOKS`)."""
    for hook in FETCH_HOOKS:
        hook(n)


_STORES: dict[tuple[str, tuple[str, ...]], Store] = {}
_LOCK = threading.Lock()


def split_url(url: str) -> tuple[str, str]:
    """(store root, key) of a URL: `s3://b/p/f` -> (`s3://b`, `p/f`); `hf://org/m@rev/f` ->
    (`https://huggingface.co`, `org/m/resolve/rev/f`)."""
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "hf":
        parts = rest.strip("/").split("/")
        if len(parts) < 2:
            raise CheckpointError(f"{url}: expected hf://ORG/MODEL[@REVISION]")
        model, _, rev = parts[1].partition("@")
        return "https://huggingface.co", "/".join([parts[0], model, "resolve", rev or "main", *parts[2:]])
    host, _, key = rest.partition("/")
    if not host:
        raise CheckpointError(f"{url}: no bucket or host in the URL")
    return f"{scheme}://{host}", key


def store_for(url: str) -> tuple[Store, str]:
    """The shared client for `url`'s store (one per root and configuration) and the key in it."""
    root, key = split_url(url)
    settings = library_settings()
    fingerprint = (*(os.environ.get(v, "") for v in _CONFIG_VARS), str(settings.store_retries), str(settings.store_timeout))
    with _LOCK:
        store = _STORES.get((root, fingerprint))
        if store is None:
            store = _STORES[(root, fingerprint)] = Store(root)
    return store, key
