"""Session fixtures of the plan tests: every architecture of `tests/support/plan_archs.py` built once, resharded once by
`reshard write --tp 2|4` with no rules, and loaded once by transformers' own TP in ONE 2-process launch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard import cli
from reshard.io.source.opener import open_source
from reshard.rules.tp_plans import SOURCE_ENV
from tests.support.dist import run_distributed
from tests.support.nd import load_nd
from tests.support.plan_archs import ARCHS, Arch, Built

COVERAGE_ENV = "RESHARD_COVERAGE_OUT"  # where the session writes its per-architecture results (JSON)


def _build(arch: Arch, root: Path) -> Built:
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = root / arch.model_type / "ckpt"
    built = Built(arch, ckpt)
    try:
        config = AutoConfig.for_model(arch.model_type, **arch.config_kwargs)
        torch.manual_seed(sum(map(ord, arch.model_type)))
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(ckpt, max_shard_size="40KB")
    except Exception as e:
        built.errors["build"] = f"{type(e).__name__}: {e}"
        return built
    for tp in (2, 4):
        out = root / arch.model_type / f"tp{tp}"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err, \
                _plans_of_the_installed_transformers():
            rc = cli.main(["write", str(ckpt), "--tp", str(tp), "-o", str(out), "--no-progress"])
        if rc != 0:
            built.errors[f"reshard write --tp {tp}"] = err.getvalue().strip()
        else:
            built.out[tp] = out
    with contextlib.suppress(Exception), _plans_of_the_installed_transformers():
        built.source = open_source(ckpt)[1].source
    return built


@contextlib.contextmanager
def _plans_of_the_installed_transformers() -> Iterator[None]:
    """`RESHARD_PLAN_SOURCE=auto` while it runs: the shipped table where transformers is the table's release (the
    same plans, byte for byte: test_plan_table), else that transformers' live plans (the newest-versions lane,
    `./run test-newest`), which are what its own TP load, the reference here, applies."""
    before = os.environ.get(SOURCE_ENV)
    os.environ[SOURCE_ENV] = "auto"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SOURCE_ENV, None)
        else:
            os.environ[SOURCE_ENV] = before


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("plans-zoo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = {a.model_type: _build(a, root) for a in ARCHS}
    # transformers' own TP (what tp_plan="auto" does under torchrun), every architecture in one launch
    jobs = [{"name": name, "ckpt": str(b.ckpt), "sizes": {"tp_size": 2, "tp_plan": "auto"},
             "out": str(b.ckpt.parent / "hf-tp2")} for name, b in built.items() if "build" not in b.errors]
    for per_rank in run_distributed(load_nd, 2, jobs, timeout=900):
        for name, found in per_rank.items():
            if "error" in found:
                built[name].errors.setdefault("transformers TP load", found["error"])
    return built


@pytest.fixture(scope="session")
def coverage() -> Iterator[dict[str, dict[str, Any]]]:
    """Per-architecture results the tests record; written to $RESHARD_COVERAGE_OUT at the end of the session."""
    results: dict[str, dict[str, Any]] = {}
    yield results
    path = os.environ.get(COVERAGE_ENV)
    if path and results:
        import transformers

        doc = {"transformers_version": transformers.__version__, "architectures": dict(sorted(results.items()))}
        Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
