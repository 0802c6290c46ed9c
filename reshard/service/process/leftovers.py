"""What killed writers leave behind, found and removed: write jobs' temp files and directories.

A write job's rank file is written to `.tmp-PID-...` (`reshard.io.outfs.TMP_PREFIX`) and renamed when
complete; a job records the directories it made (`Job.made_dirs`). A worker that is SIGKILLed leaves
both. `clean_after` removes them for one job once every thread of its dead worker has ended;
`sweep_out` (at a worker's start) removes every temp file under OUT/NAME/tp-N whose writer is gone.
Upload temp files are swept the same way by `reshard.service.api.uploads.remove_dead_uploads`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from reshard.io.outfs import TMP_PREFIX
from reshard.layout.mesh import DIR_NAME
from reshard.service.process.lifecycle import pid_gone, wait_exited

log = logging.getLogger("reshard.service")
EXIT_WAIT = 30.0  # seconds a dead worker's threads may take to end before its leftovers are swept
_TMP = re.compile(rf"^{re.escape(TMP_PREFIX)}(\d+)-")
DirLock = Callable[..., AbstractContextManager[bool]]  # (directory, wait=False) -> whether it is free


def remove_dead(directory: Path, dead: Callable[[Path], bool]) -> int:
    """Remove the files of `directory` that `dead` says a gone writer left; how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for p in list(directory.iterdir()):
            with contextlib.suppress(OSError):
                if dead(p):
                    p.unlink()
                    removed += 1
    return removed


def _dead_write_temp(path: Path) -> bool:
    m = _TMP.match(path.name)
    return m is not None and pid_gone(int(m.group(1)), last_write=path.lstat().st_mtime)


def remove_dead_temps(directory: Path) -> int:
    """Remove the temp files (`.tmp-PID-*`) in `directory` whose writer is gone; how many."""
    return remove_dead(directory, _dead_write_temp)


def remove_made(made: list[str]) -> None:
    """Remove the directories a job made, deepest first, as long as they are empty (nothing published)."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            continue
        except OSError:  # not empty: it and its parents stay
            return


def clean_after(output_dir: Path, made_dirs: list[str], owner: str, dir_lock: DirLock) -> None:
    """The temp files and the (empty) directories a job of the dead worker `owner` left."""
    if not wait_exited(owner, timeout=EXIT_WAIT):
        log.warning("worker %s writing %s has not ended after %g s; its temp files are left to the next "
                    "worker that starts", owner, output_dir, EXIT_WAIT)
        return
    remove_dead_temps(output_dir)
    try:
        with dir_lock(output_dir, wait=False) as free:
            if free:  # else a live job writes there now
                remove_made(made_dirs)
    except OSError as e:  # no lock file to be had (STATE full...): the directories stay
        log.warning("cannot lock %s to remove it: %s", output_dir, e)


def sweep_out(out: Path, dir_lock: DirLock) -> None:
    """Temp files of gone writers in every OUT/NAME/tp-N; that directory (and NAME) if then empty."""
    try:
        names = [d for d in out.iterdir() if not d.name.startswith(".") and d.is_dir() and not d.is_symlink()]
    except OSError:
        return
    removed = 0
    for name in names:
        with contextlib.suppress(OSError):
            for tp_dir in name.iterdir():
                if DIR_NAME.match(tp_dir.name) and tp_dir.is_dir() and not tp_dir.is_symlink():
                    n = remove_dead_temps(tp_dir)
                    removed += n
                    if n:
                        with dir_lock(tp_dir, wait=False) as free:  # (an OSError: it stays)
                            if free:
                                remove_made([str(name), str(tp_dir)])
    if removed:
        log.warning("removed %d temp files that killed writers left in %s", removed, out)
