"""A checkpoint's small files: what an inference engine reads besides the weights (config, tokenizer).

vLLM needs a local directory with `config.json` and the tokenizer even when every weight comes from a
rank shard; the service serves these files (`GET /v1/checkpoints/NAME/meta`) and `reshard pull URL
--meta -o DIR` (or the vLLM plugin) copies them. Only these names, each at most `MAX_META_BYTES`.
`trainer_state.json` is a training checkpoint's non-tensor state (`reshard.trainer.state_json`): what
`--resume URL` reads besides the parameters and the optimizer's moments.
"""

from __future__ import annotations

import re

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
