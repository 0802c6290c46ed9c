"""One small exception hierarchy. Every error names the file, the tensor, the numbers and the fix.

The service maps these classes to HTTP status codes in one place (`reshard/service/http_errors.py`) through
`http_status`; the CLI prints `str(error)` as one line and exits non-zero.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Base of every error reshard raises on bad input."""

    http_status = 400


class HeaderError(ReshardError):
    """A safetensors header is malformed or inconsistent with its file."""

    http_status = 422


class CheckpointError(ReshardError):
    """A checkpoint directory is incomplete or inconsistent (index.json, files, config.json)."""

    http_status = 422


class ManifestError(ReshardError):
    """A rule manifest is malformed or does not fit the checkpoint."""

    http_status = 422


class RegistryError(ReshardError):
    """A kind registered twice, or an unknown kind asked for."""

    http_status = 422


class PlanError(ReshardError):
    """A tensor cannot be split as asked (divisibility, heads, padding), or rank/tp out of range."""

    http_status = 422


class SourceChangedError(ReshardError):
    """A source file changed while its bytes were being read."""

    http_status = 409


class IntegrityError(ReshardError):
    """Downloaded or written bytes do not match their expected length or digest."""

    http_status = 502


class NotFoundError(ReshardError):
    """A named checkpoint, manifest, job or file does not exist."""

    http_status = 404


class OutputError(ReshardError):
    """Writing an output failed because of where it goes: its file system or its path (not the input).

    One subclass per cause (see `reshard.io.outfs.output_error`, which turns an `OSError` into one). The
    HTTP status is what the service answers when it is the one writing (uploads, jobs).
    """

    http_status = 507


class NoSpaceError(OutputError):
    """The output file system is full (ENOSPC), or too full for what is planned."""

    http_status = 507


class QuotaError(OutputError):
    """The disk quota of the output file system is used up (EDQUOT)."""

    http_status = 507


class ReadOnlyError(OutputError):
    """The output file system is mounted read-only (EROFS)."""

    http_status = 503


class OutputPermissionError(OutputError):
    """No permission to write the output directory or file (EACCES, EPERM)."""

    http_status = 503


class OutputPathError(OutputError):
    """The output path cannot be a directory of files: it names a file, or a parent is a file (EEXIST, ENOTDIR, EISDIR)."""

    http_status = 409


class OutputIOError(OutputError):
    """The output device reported an I/O error (EIO)."""

    http_status = 503


class StateUnavailableError(ReshardError):
    """The service's state database (jobs, digests shared by its workers) cannot be used now: read-only or
    immutable files, an I/O error, a lock held too long. Job routes answer 503; shard downloads go on."""

    http_status = 503


class StateFullError(StateUnavailableError):
    """The file system of the service's state database is full (SQLITE_FULL, ENOSPC): job routes answer
    507 until space is freed there; shard downloads go on."""

    http_status = 507


class PeerFailedError(ReshardError):
    """Another rank of a distributed run failed, so this one stops too (instead of waiting for it)."""

    http_status = 503


class StoreError(ReshardError):
    """An object store or HTTP server refused or failed a request (no such bucket, access denied,
    a 5xx after retries): the server's side, so the service answers 502."""

    http_status = 502


class StoreUnavailableError(StoreError):
    """An object store or HTTP server could not be reached (connection refused, timeouts) after retries."""

    http_status = 503
