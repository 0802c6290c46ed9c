"""The plugin as vLLM finds it: the `vllm.general_plugins` entry point of the installed package (the only
way into vLLM's worker processes) registers load_format "reshard"; importing the plugin's package imports
nothing of vLLM (checked in a fresh interpreter, which imports no vLLM either)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest


@pytest.mark.pure
def test_vllm_loads_the_entry_point_and_it_registers_the_loader() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins, load_plugins_by_group

    import reshard.integrations.vllm as plugin
    from reshard.integrations.vllm.loader import ReshardModelLoader

    (ep,) = [e for e in entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == "reshard"]
    assert ep.value == "reshard.integrations.vllm:register"
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["reshard"] is plugin.register  # what vLLM runs
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="reshard", model_loader_extra_config={"shards": "/x"}))
    assert type(loader) is ReshardModelLoader and loader.options == {"shards": "/x"}


@pytest.mark.multiproc
def test_importing_the_plugin_imports_no_vllm() -> None:
    code = ("import sys\n"
            "import reshard.integrations.vllm\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
