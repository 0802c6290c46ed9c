"""One small exception hierarchy. Every error names the file, the tensor, the numbers and the fix.

They know nothing of HTTP: the service maps these classes to status codes in one table
(`reshard/service/http_errors.py`); the CLI prints `str(error)` as one line and exits non-zero.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Base of every error reshard raises on bad input."""


class HeaderError(ReshardError):
    """A safetensors header is malformed or inconsistent with its file."""


class CheckpointError(ReshardError):
    """A checkpoint directory is incomplete or inconsistent (index.json, files, config.json)."""


class ManifestError(ReshardError):
    """A rule manifest is malformed or does not fit the checkpoint."""


class RegistryError(ReshardError):
    """A kind registered twice, or an unknown kind asked for."""


class PlanError(ReshardError):
    """A tensor cannot be split as asked (divisibility, heads, padding), or rank/tp out of range."""


class TpMismatchError(PlanError):
    """A tensor's split does not fit this tp (a size, heads or blocks it does not divide). `fact` says what
    does not fit, `fix` the tensor's own way out, `pad` whether the rule's `pad: true` would make it fit;
    the planner replaces `fix` by the tp values that plan the whole checkpoint (`reshard.plan.advice`)."""

    def __init__(self, fact: str, fix: str = "", *, pad: bool = False, where: str = "") -> None:
        super().__init__(f"{fact}; {fix}{where}" if fix else f"{fact}{where}")
        self.fact, self.fix, self.pad, self.where = fact, fix, pad, where


class BoxError(ReshardError):
    """A request for boxes of tensors (`reshard.format.box_request`) that cannot be answered: an unknown
    tensor, a box past its end, more boxes or bytes than allowed."""


class SourceChangedError(ReshardError):
    """A source file changed while its bytes were being read."""


class IntegrityError(ReshardError):
    """Downloaded or written bytes do not match their expected length or digest."""


class NotFoundError(ReshardError):
    """A named checkpoint, manifest, job or file does not exist."""


class OutputError(ReshardError):
    """Writing an output failed because of where it goes: its file system or its path (not the input).

    One subclass per cause (see `reshard.io.outfs.output_error`, which turns an `OSError` into one).
    """


class NoSpaceError(OutputError):
    """The output file system is full (ENOSPC), or too full for what is planned."""


class QuotaError(OutputError):
    """The disk quota of the output file system is used up (EDQUOT)."""


class ReadOnlyError(OutputError):
    """The output file system is mounted read-only (EROFS)."""


class OutputPermissionError(OutputError):
    """No permission to write the output directory or file (EACCES, EPERM)."""


class OutputPathError(OutputError):
    """The output path cannot be a directory of files: it names a file, or a parent is a file (EEXIST, ENOTDIR, EISDIR)."""


class OutputIOError(OutputError):
    """The output device reported an I/O error (EIO)."""


class StateUnavailableError(ReshardError):
    """The service's state database (jobs, digests shared by its workers) cannot be used now: read-only or
    immutable files, an I/O error, a lock held too long. Job routes answer 503; shard downloads go on."""


class StateFullError(StateUnavailableError):
    """The file system of the service's state database is full (SQLITE_FULL, ENOSPC): job routes answer
    507 until space is freed there; shard downloads go on."""


class PeerFailedError(ReshardError):
    """Another rank of a distributed run failed, so this one stops too (instead of waiting for it)."""


class StoreError(ReshardError):
    """An object store or HTTP server refused or failed a request (no such bucket, access denied,
    a 5xx after retries): the server's side, so the service answers 502."""


class StoreUnavailableError(StoreError):
    """An object store or HTTP server could not be reached (connection refused, timeouts) after retries."""


class MissingDependencyError(ReshardError):
    """A feature needs a package that is not installed (torch, transformers): the error names the extra
    that brings it."""


# what `pip install 'reshard[EXTRA]'` brings, for each package a feature may need beyond the base install
EXTRA_OF = {"torch": "train", "transformers": "train", "accelerate": "train"}


def missing_dependency(module: str, what: str) -> MissingDependencyError:
    """The one-line error for `what` needing the top-level package `module`, which is not installed."""
    extra = EXTRA_OF.get(module)
    fix = f"pip install 'reshard[{extra}]'" if extra else f"pip install {module}"
    return MissingDependencyError(f"{what} needs {module}, which is not installed here; {fix}")


def require(*modules: str, what: str) -> None:
    """Raise `missing_dependency` for the first of the top-level packages `modules` that cannot be imported
    (found without importing it)."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing_dependency(module, what)
