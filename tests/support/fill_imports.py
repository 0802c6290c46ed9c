"""`python -m tests.support.fill_imports RANK_FILE [URL]`: `fill_model` of a plain torch model (its parameters
named and shaped as the rank file's tensors) from the file, and from the service's URL when given, in a
fresh interpreter; prints JSON: which of the heavy modules got imported, and whether the values equal
the file's. For tests/fill/test_fill_mapped.py (the fill path imports neither httpx nor pydantic-settings)."""

from __future__ import annotations

import json
import sys

HEAVY = ("httpx", "pydantic", "pydantic_settings", "transformers", "fastapi", "obstore", "yaml")


def plain_model(entries: dict) -> object:
    import torch
    from torch import nn

    from reshard.format.torch_side import TORCH_DTYPES

    root = nn.Module()
    for name, e in entries.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.empty(e["shape"], dtype=TORCH_DTYPES[e["dtype"]])))
    return root


def main(path: str, url: str | None) -> dict:
    import reshard  # noqa: F401  the package alone first

    after_import = [m for m in HEAVY if m in sys.modules]
    import torch
    from safetensors import safe_open

    from reshard.fill.into_params import read_header_from
    from reshard.io.client.body import file_body

    body = file_body(path)
    header, _ = read_header_from(body, path)
    body.close()
    want = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():
            want[k] = f.get_tensor(k)
    out = {"after_import": after_import, "sources": {}}
    for source in [path, *([url] if url else [])]:
        model = plain_model(header.entries)
        report = reshard.fill_model(model, source)
        state = model.state_dict()
        out["sources"][source] = {"equal": all(torch.equal(state[k], want[k]) for k in want) and len(state) == len(want),
                                  "mapped": report.mapped, "verified": report.verified}
    out["after_fill"] = [m for m in HEAVY if m in sys.modules]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)))
