"""`reshard completion bash|zsh|fish`: the shell code that completes `reshard` commands and flags.

    eval "$(reshard completion bash)"        # in ~/.bashrc (zsh: ~/.zshrc with `zsh`)
    reshard completion fish > ~/.config/fish/completions/reshard.fish

The completions come from the command's own parser through argcomplete: the shell calls `reshard`
with argcomplete's variables set, and `reshard.cli.main` answers before parsing anything.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reshard.cli.common import command
from reshard.errors import missing_dependency

SHELLS = ("bash", "zsh", "fish")


def shell_code(shell: str) -> str:
    """The script that registers completion of `reshard` in `shell`."""
    try:
        import argcomplete
    except ModuleNotFoundError:
        raise missing_dependency("argcomplete", "shell completion") from None
    return argcomplete.shellcode(["reshard"], shell=shell)


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(shell_code(args.shell))
    return 0


def add_commands(sub: Any) -> None:
    p = command(sub, "completion", help="print the shell code that completes reshard's commands and flags",
                examples_=('eval "$(reshard completion bash)"       # add it to ~/.bashrc',
                           'eval "$(reshard completion zsh)"        # add it to ~/.zshrc',
                           "reshard completion fish > ~/.config/fish/completions/reshard.fish"))
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=cmd_completion)
