"""Session fixtures of the trainer tests: tiny checkpoints of every tested architecture and their shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F

from tests.support.trainer_archs import ARCHS, GRADS, IDS, TP4, make_checkpoint, reference_model, write_shards


@pytest.fixture(scope="session")
def arch_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per architecture: `NAME/full` (save_pretrained) and its rank shards `NAME/tpN` (tp 1, 2; 4 for TP4)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("archs")
    for name in ARCHS:
        full = make_checkpoint(name, root / name / "full")
        for tp in (1, 2, 4) if name in TP4 else (1, 2):
            write_shards(full, tp, root / name / f"tp{tp}")
    return root


@pytest.fixture(scope="session")
def references(arch_work: Path) -> dict[str, dict[str, Any]]:
    """transformers' own single-process model on the full checkpoint: logits, loss, gradients."""
    out = {}
    for name in ARCHS:
        model = reference_model(arch_work / name / "full")
        logits = model(input_ids=IDS).logits
        loss = F.cross_entropy(model(input_ids=IDS[:, :-1]).logits.flatten(0, 1), IDS[:, 1:].flatten())
        ref = {"logits": logits.detach(), "loss": loss.item()}
        if name in GRADS:
            loss.backward()
            ref["grads"] = {k: p.grad for k, p in model.named_parameters()}
        out[name] = ref
    return out
