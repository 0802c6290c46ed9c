"""Each output-side errno becomes its own `OutputError` with the path, the cause and the fix, and the
service answers each with its status (the causes a test machine cannot produce for real: EIO, EDQUOT,
EACCES as root, are checked here through the same function the writers use)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from reshard import errors
from reshard.cli.commands import rank_list
from reshard.io.outfs import check_space, output_error, output_errors

pytestmark = pytest.mark.pure

CASES = [
    (errno.ENOSPC, errors.NoSpaceError, 507, "no space left on device", "free some space or write elsewhere"),
    (errno.EDQUOT, errors.QuotaError, 507, "disk quota exceeded", "free some of your files there"),
    (errno.EROFS, errors.ReadOnlyError, 503, "read-only file system", "remount it read-write"),
    (errno.EACCES, errors.OutputPermissionError, 503, "permission denied", "fix its permissions"),
    (errno.EPERM, errors.OutputPermissionError, 503, "permission denied", "fix its permissions"),
    (errno.EEXIST, errors.OutputPathError, 409, "exists and is not a directory", "give a directory"),
    (errno.EISDIR, errors.OutputPathError, 409, "is a directory where a file must go", "move it away"),
    (errno.EIO, errors.OutputIOError, 503, "I/O error on the output device", "check the disk"),
]


@pytest.mark.parametrize(("code", "cls", "status", "cause", "fix"), CASES, ids=[errno.errorcode[c[0]] for c in CASES])
def test_errno_to_typed_error(tmp_path: Path, code: int, cls: type, status: int, cause: str, fix: str) -> None:
    from reshard.service.http_errors import response_for, status_for

    target = tmp_path / "out" / "rank-00001-of-00002.safetensors"
    err = output_error(OSError(code, os.strerror(code), str(target)), tmp_path, retry="try again")
    assert type(err) is cls and isinstance(err, errors.OutputError)
    text = str(err)
    assert text.startswith(f"{target}: {cause}") and fix in text, text
    assert "\n" not in text
    assert status_for(err) == status
    raw = OSError(code, os.strerror(code), str(target))  # untyped: the service types the write-side ones
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        body = json.loads(response_for(raw).body)
        assert (status_for(raw), body["error"]) == (status, cls.__name__) and cause in body["detail"]


def test_temp_names_are_not_shown_and_other_errnos_pass(tmp_path: Path) -> None:
    final = tmp_path / "reshard.json"
    err = output_error(OSError(errno.ENOSPC, "No space", str(tmp_path / ".tmp-123-reshard.json")), final)
    assert str(err).startswith(f"{final}: no space left on device")
    assert output_error(OSError(errno.ECONNRESET, "reset"), tmp_path) is None
    with pytest.raises(ConnectionResetError), output_errors(tmp_path):
        raise ConnectionResetError(errno.ECONNRESET, "reset")


def test_enotdir_names_the_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    target = tmp_path / "afile" / "sub" / "x"
    err = output_error(OSError(errno.ENOTDIR, "Not a directory", str(target)), target)
    assert isinstance(err, errors.OutputPathError)
    assert str(err).startswith(f"{target}: {tmp_path / 'afile'} is a file, not a directory")


def test_check_space_numbers(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    check_space(tmp_path / "new" / "dir", 1)  # asks the nearest existing parent
    with pytest.raises(errors.NoSpaceError) as e:
        check_space(tmp_path, free + 10**12)
    want = f"needs {(free + 10**12) / 1e6:.1f} MB in {tmp_path}, "
    assert str(e.value).startswith(want), str(e.value)


def test_rank_list() -> None:
    assert rank_list([0]) == "rank 0"
    assert rank_list([1, 2, 3]) == "ranks 1-3"
    assert rank_list([3, 0, 2]) == "ranks 0, 2-3"
