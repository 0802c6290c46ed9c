"""What a rank runs under `reshard launch` in tests/launch: `python -m tests.support.launch_rank MODE OUT_DIR`.

    env    report the environment, argv, what was imported before the rank started, seeds; all-reduce the ranks
    fail   rank 1 exits with status 3; the others sleep (stuck, as in a collective its peer never joins)
    sleep  note that the rank is up, then sleep; on SIGINT note it and exit 7 (SIGTERM: the default, death)

Each rank writes OUT_DIR/rank-R.json (env), OUT_DIR/up-R (sleep) and OUT_DIR/sigint-R (SIGINT).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

PRELOADED = {m: m in sys.modules for m in ("torch", "transformers", "transformers.models.llama.modeling_llama",
                                           "reshard.fill")}
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "RESHARD_T0")


def _env(out: Path) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    report = {"env": {k: os.environ.get(k) for k in KEYS}, "argv": sys.argv, "name": __name__,
              "elastic": sorted(k for k in os.environ if k.startswith("TORCHELASTIC_")), "preloaded": PRELOADED,
              "own_group": os.getpgid(0) == os.getpid(), "rand": torch.rand(1).item(), "ppid": os.getppid()}
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    report["sum"] = t.item()
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _fail() -> None:
    if os.environ["RANK"] == "1":
        print("rank 1: failing on purpose", file=sys.stderr, flush=True)
        raise SystemExit(3)
    time.sleep(120)  # only the launcher can end this


def _sleep(out: Path) -> None:
    rank = os.environ["RANK"]
    (out / f"up-{rank}").write_text(str(os.getpid()))
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        (out / f"sigint-{rank}").write_text("")
        raise SystemExit(7) from None


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"env": lambda: _env(out_dir), "fail": _fail, "sleep": lambda: _sleep(out_dir)}[mode]()
