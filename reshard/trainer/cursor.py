"""The global data order: sample i of a run is a pure function of (seed, i).

Sample i is the window of `seq_len + 1` tokens starting at `window_start(seed, i, n)` of the token
stream (n = the number of possible starts), a splitmix64 hash of (seed, i): no generator state to
carry, so the order depends on the seed alone. Step s of a run with global batch B reads samples
[s*B, (s+1)*B); data rank d of D reads its contiguous B/D of them. The data cursor, the samples
consumed so far, is all a resume needs to continue the order, whatever the layout.
"""

from __future__ import annotations

import torch

from reshard.errors import ReshardError

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def window_start(seed: int, index: int, starts: int) -> int:
    """Where sample `index` of the run seeded `seed` starts, in [0, starts)."""
    return _splitmix64(_splitmix64(seed & _MASK) ^ (index & _MASK)) % starts


def sample_windows(tokens: torch.Tensor, *, seed: int, first: int, count: int, seq_len: int) -> torch.Tensor:
    """Samples `first` .. `first + count - 1`: a (count, seq_len + 1) tensor of token windows."""
    starts = len(tokens) - seq_len - 1
    if starts < 1:
        raise ReshardError(f"the data has {len(tokens)} tokens, fewer than seq-len {seq_len} + 2; "
                           f"use a longer text or a smaller --seq-len")
    return torch.stack([tokens[s : s + seq_len + 1] for s in
                        (window_start(seed, i, starts) for i in range(first, first + count))])


def local_share(batch_size: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """(offset, count) of data rank `dp_rank`'s samples within a global batch of `batch_size`."""
    if batch_size % dp:
        raise ReshardError(f"--batch-size {batch_size} is the global batch and must divide evenly across "
                           f"--dp {dp} data ranks; pick a multiple of {dp}")
    per = batch_size // dp
    return dp_rank * per, per


__all__ = ["local_share", "sample_windows", "window_start"]
