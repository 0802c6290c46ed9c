"""The transformers side of the plan tests: every architecture loaded with transformers' own TP, in one launch.

`dump_hf_tp(rank, world_size, jobs)` runs on each gloo rank (see `tests/support/dist.py`): for every
(name, checkpoint, out prefix) job it loads the checkpoint with `from_pretrained(...,
distributed_config=DistributedConfig(tp_size=world_size, tp_plan="auto"))` (what `tp_plan="auto"`
does under torchrun) and saves this rank's local tensors (`DTensor.to_local()`, plain tensors as they
are) to `{out}-rank{rank}.safetensors`. Failures are returned per architecture, not raised, so one
architecture's failure shows in its own test.
"""

from __future__ import annotations

import os
import warnings


def dump_hf_tp(rank: int, world_size: int, jobs: list[tuple[str, str, str]]) -> dict[str, str]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    import torch
    import transformers
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    errors: dict[str, str] = {}
    for name, ckpt, out in jobs:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, distributed_config=DistributedConfig(tp_size=world_size, tp_plan="auto"), dtype=torch.float32)
            local = {}
            for key, value in model.state_dict().items():
                t = value.to_local() if isinstance(value, DTensor) else value
                local[key] = t.detach().clone().contiguous()
            save_file(local, f"{out}-rank{rank}.safetensors")
        except Exception as e:  # reported per architecture by the comparing test
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return errors
