"""A checkpoint's small files: what an inference engine reads besides the weights (config, tokenizer).

vLLM needs a local directory with `config.json` and the tokenizer even when every weight comes from a
rank shard; the service serves these files (`GET /v1/checkpoints/NAME/meta`) and `reshard pull URL
--meta -o DIR` (or the vLLM plugin) copies them. Only these names, each at most `MAX_META_BYTES`.
`trainer_state.json` is a training checkpoint's non-tensor state (`reshard.trainer.state_json`): what
`--resume URL` reads besides the parameters and the optimizer's moments.
"""

from __future__ import annotations

import re
from typing import Any

from reshard.errors import IntegrityError

META_NAMES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json", "trainer_state.json",
)
META_PATTERN = "^(" + "|".join(re.escape(n) for n in META_NAMES) + ")$"
MAX_META_BYTES = 256 << 20  # the largest tokenizer.json files are tens of MB
# what travels with the weights when they are re-laid out (`reshard write`) or merged (`reshard merge`): every
# small file but the training state, which describes the rank files it came with
KEPT_NAMES = tuple(n for n in META_NAMES if n != "trainer_state.json")


def is_meta_file(name: str) -> bool:
    return name in META_NAMES


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_listing(listing: Any, where: str) -> list[dict[str, Any]]:
    """The `files` of a `GET .../meta` answer, checked before a byte of any file is fetched: each entry a
    name of `META_NAMES` (so never a path: no `..`, no `/`), listed once, a size of 0 to `MAX_META_BYTES`
    and a sha256 of 64 hex digits; anything else is one `IntegrityError` naming the entry."""
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, list):
        raise IntegrityError(f"{where}: the listing has no list of files; is this the service's checkpoint URL?")
    seen: set[str] = set()
    for f in files:
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not is_meta_file(name):
            raise IntegrityError(f"{where}: the server lists {repr(name)[:200]}, which is not one of a checkpoint's "
                                 f"small files ({', '.join(META_NAMES)}); nothing was written")
        size, sha = f.get("size"), f.get("sha256")
        if name in seen:
            raise IntegrityError(f"{where}: the server lists {name} twice; nothing was written")
        if type(size) is not int or not 0 <= size <= MAX_META_BYTES:
            raise IntegrityError(f"{where}: the server lists {name} with size {repr(size)[:40]}, not 0 to "
                                 f"{MAX_META_BYTES} bytes; nothing was written")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise IntegrityError(f"{where}: the server lists {name} with sha256 {repr(sha)[:80]}, not 64 hex "
                                 "digits; nothing was written")
        seen.add(name)
    return files
