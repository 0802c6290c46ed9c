"""reshard: lazy per-rank tensor-parallel resharding of safetensors checkpoints.

The public API, in the order of the data flow::

    source, manifest = open_source("ckpt/")          # every header validated, the rules resolved
    plan = make_plan(source, manifest, 4)             # pure: what every rank file holds, byte for byte
    plan = make_plan(source, manifest, Layout(tp=2, pp=2, fsdp=2))   # any layout: pp x fsdp x tp, experts on ep
    write_shards(source, plan, "out/")                # rank files + reshard.json, atomically
    model = empty_tp_model("out/")                    # a transformers TP model, no weights read
    fill_model(model, "out/")                         # this rank's shard into its parameters
    a, b = read_boxes("ckpt/", [Box("lm_head.weight", (0, 0), (64, 4096)), ...])   # blocks of tensors, any source

`fill_model` and `empty_tp_model` need torch and transformers; `read_boxes` needs torch. Every name but `Layout` and
`ReshardError` is imported on first use, so `import reshard` stays cheap and a process that only
fills a model (from rank files or the service) never imports the HTTP, settings or planning stacks.

Importing reshard defines these names and does nothing else: no other library is patched, no file is
written. `enable_import_cache()` is the one switch: a transformers imported after it does not read its
own source tree to learn what it exports, that is kept on disk while the tree is unchanged
(`reshard.importcache`), 0.6 s less per process on a 2-core machine. reshard's own entry points (the
`reshard` commands, `reshard launch`, the trainer, `empty_tp_model` before it imports transformers)
call it; a worker of your own may, first thing.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from reshard.errors import ReshardError
from reshard.layout import Layout

__version__ = "0.1.0"
__all__ = ["Box", "Layout", "ReshardError", "__version__", "empty_tp_model", "enable_import_cache", "fill_model",
           "make_plan", "open_source", "read_boxes", "write_shards"]

_LAZY = {"open_source": "reshard.io.source.opener", "write_shards": "reshard.io.sinks.write", "make_plan": "reshard.plan.planner",
         "fill_model": "reshard.fill", "empty_tp_model": "reshard.fill", "read_boxes": "reshard.fill.box_fill",
         "Box": "reshard.format.box_request"}


def enable_import_cache() -> None:
    """Keep transformers' import structure on disk from the next `import transformers` on, so that it
    does not read its whole source tree (`reshard.importcache`; where: `RESHARD_IMPORT_CACHE_DIR`).
    Call it before transformers is imported; after, it does nothing. Idempotent."""
    from reshard import importcache

    importcache.install()


def __getattr__(name: str) -> Any:
    """The public API's functions, each imported from its module on first use."""
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
