"""The plugin as vLLM finds it: the `vllm.general_plugins` entry point of the installed package (the only
way into vLLM's worker processes) registers load_format "reshard"; nothing of vLLM is imported before."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.pure


def test_entry_point_registers_the_loader_in_a_fresh_process() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "reshard"]
    assert ep.value == "reshard.integrations.vllm:register"
    code = ("import sys\n"
            "import reshard.integrations.vllm\n"
            "assert 'vllm' not in sys.modules, 'importing the plugin package imported vLLM'\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from vllm.model_executor.model_loader import get_model_loader\n"
            "from vllm.config.load import LoadConfig\n"
            "loader = get_model_loader(LoadConfig(load_format='reshard', model_loader_extra_config={'shards': '/x'}))\n"
            "print(type(loader).__module__, type(loader).__name__, loader.options)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "reshard.integrations.vllm.loader ReshardModelLoader {'shards': '/x'}"
