"""`reshard completion bash` in a real bash: the script it prints, sourced, completes commands, flags and
choices by asking `reshard` itself (argcomplete's protocol), as a user's shell does at TAB."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _complete(tmp_path: Path, words: list[str]) -> list[str]:
    """What bash offers at the end of `words` (the last one being completed) once the script is sourced."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "reshard"  # the console script, as pip makes it: this interpreter, this tree
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m reshard.cli \"$@\"\n")
    exe.chmod(0o755)
    line = " ".join(words)
    script = ('eval "$(reshard completion bash)"\n'
              f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
              f"COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}\n"
              '_python_argcomplete reshard\nprintf "%s\\n" "${COMPREPLY[@]}"\n')
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    return sorted(w.strip() for w in out.stdout.splitlines() if w.strip())


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_bash_completes_commands_flags_and_choices(tmp_path: Path) -> None:
    assert _complete(tmp_path, ["reshard", "wr"]) == ["write"]
    assert _complete(tmp_path, ["reshard", "m"]) == ["merge"]
    assert _complete(tmp_path, ["reshard", "write", "--fo"]) == ["--force"]
    assert _complete(tmp_path, ["reshard", "plan", "--log-l"]) == ["--log-level"]
    assert _complete(tmp_path, ["reshard", "completion", "z"]) == ["zsh"]
    assert _complete(tmp_path, ["reshard", "serve", "--log-level", "w"]) == ["warning"]
