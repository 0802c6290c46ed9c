"""`reshard launch`: the ranks of one node forked from a process that imported the heavy modules once.

    reshard launch --nproc-per-node 2 -m reshard.cli.train --shards http://HOST:8000/v1/checkpoints/llama
    reshard launch --nproc-per-node 4 --preload shards/ worker.py ARGS...
    python -m reshard.cli.launch ...                    # the same

A TP worker's start-up is mostly imports: torch, transformers, and transformers' config and model
modules (which pull torch.distributed.tensor, accelerate, torch._dynamo) take ~4 CPU-seconds, and
under torchrun every rank pays them, all at once, on the same cores. The launcher imports them once
and forks the ranks, which inherit the imported modules (copy-on-write memory: shared until written).
transformers' import reads its whole `models/` source tree; the launcher switches the import cache on
(`reshard.enable_import_cache()`), so what that finds is kept on disk (`reshard.importcache`): 0.6 s
less on a 2-core machine.

The ranks see torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT (a free port of
MASTER_ADDR unless `--master-port`), OMP_NUM_THREADS=1 unless set, and no TORCHELASTIC_* variable
(there is no agent: rank 0's `init_process_group` starts the store, as with a static rendezvous).
RESHARD_T0 (the launch time, unless set) lets a rank count its start-up from the launch.
Several nodes: the same command on each, `--nnodes M --node-rank K --master-addr HOST --master-port P`.

What is imported before the fork: torch, torch.distributed(.tensor), transformers and its modeling
utilities, `reshard.fill` (and `reshard.trainer` for `-m reshard.cli.train`), `--import MODULE`s, and
for each `--preload SOURCE` (a checkpoint or shard directory, a rank file, the service's checkpoint
URL; for the trainer its `--shards` by default) the config and model classes of its config.json.
Nothing else runs there: no model is built (but a one-layer copy on the meta device, to warm up
transformers' first build), no tensor op runs. Before those imports, `--prefetch URL` forks one
fetcher per rank that pulls the rank's shard of tp=WORLD_SIZE from the service into shared memory
while the launcher imports; the rank's `fill_model(model, URL)` (or the trainer's `--shards URL`) then
maps it (`reshard.io.client.shard_prefetch`): the transfer overlaps the imports. That pays where the network is
the bottleneck (bench/compare_link.py), and on few cores too: the imports run on one thread, and the
fetchers, at the lowest CPU priority, take the cores they leave idle.

Fork-safety, the constraints the launcher keeps and a script run under it must too:
- No CUDA before the fork: the launcher refuses to fork once CUDA is initialized. Each rank picks its
  own device (`torch.cuda.set_device(LOCAL_RANK)`), as under torchrun.
- No thread before the fork (a lock a thread holds stays held in every child): the launcher warns,
  naming them. torch's intra-op thread pool, process groups, CUDA contexts exist only in the ranks.
- Each rank is its own process group (`setpgid`): a terminal's Ctrl-C reaches the launcher only,
  which forwards SIGINT and SIGTERM to every rank, and SIGKILLs those left after `--grace` seconds.
  A rank dies with the launcher (PR_SET_PDEATHSIG).
- A rank that exits non-zero stops the others: the launcher prints one line naming it, SIGTERMs the
  rest (SIGKILL after `--grace`) and exits with that rank's status (128 + N for a signal N).
- Each rank draws fresh seeds, as a fresh process does: torch's CPU generator, numpy's legacy global
  generator, Python's `random` (which reseeds itself at a fork).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from reshard import enable_import_cache
from reshard.cli.common import HelpFormatter, add_common_flags, command, examples, setup_logging
from reshard.errors import ReshardError, require
from reshard.io.owners import die_with
from reshard.settings import env_name

PROG = "reshard launch"
PREFETCH_ENV = env_name("prefetch")  # reshard.io.client.shard_prefetch.ENV, named here so that the launcher imports nothing early
MODULES = ("torch", "torch.distributed", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
           "reshard.fill")
TRAINER = "reshard.cli.train"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N", help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (static: the same command on each, with --node-rank)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rank 0's store port (default: a free port, on one node; 29500 on several)")
    p.add_argument("--preload", action="append", default=[], metavar="SOURCE",
                   help="import the config and model classes of this checkpoint, shard directory, rank file or "
                        "checkpoint URL before forking (repeatable; the trainer's --shards by default)")
    p.add_argument("--prefetch", metavar="URL", default=None,
                   help="fetch each rank's shard of the tp=WORLD_SIZE layout from this checkpoint URL of the service "
                        "while the launcher imports; a fill of that URL (and rank, layout) in the rank takes it")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="also import this module before forking (repeatable)")
    p.add_argument("--no-preload", action="store_true", help="import nothing before forking")
    p.add_argument("--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL when stopping ranks")
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module, as with python -m")
    p.add_argument("target", metavar="TARGET", help="the script (or, with -m, the module) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")


def rank_env(args: argparse.Namespace, local: int, port: int) -> dict[str, str]:
    """torchrun's variables for local rank `local` (static rendezvous, no elastic agent)."""
    per, world = args.nproc_per_node, args.nnodes * args.nproc_per_node
    rank = args.node_rank * per + local
    env = {"RANK": rank, "LOCAL_RANK": local, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": per,
           "GROUP_RANK": args.node_rank, "GROUP_WORLD_SIZE": args.nnodes, "ROLE_RANK": rank,
           "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", "MASTER_ADDR": args.master_addr, "MASTER_PORT": port}
    return {k: str(v) for k, v in env.items()}


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def trainer_source(args: argparse.Namespace) -> str | None:
    """The trainer's `--shards` value, when the target is the bundled trainer."""
    if not (args.module and args.target == TRAINER):
        return None
    for i, a in enumerate(args.args):
        if a == "--shards" and i + 1 < len(args.args):
            return args.args[i + 1]
        if a.startswith("--shards="):
            return a.split("=", 1)[1]
    return None


def prefetch(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Fork one fetcher per local rank (`reshard.io.client.shard_prefetch`); local rank -> what the rank needs to find it."""
    url = args.prefetch
    if not url or not url.startswith(("http://", "https://")) or "/v1/checkpoints/" not in url:
        return {}
    from reshard.io.client import shard_prefetch as fetch

    world = args.nnodes * args.nproc_per_node
    return {local: fetch.start(url, args.node_rank * args.nproc_per_node + local, world)
            for local in range(args.nproc_per_node)}


def _keep_own(fetches: dict[int, dict[str, Any]], local: int | None) -> None:
    """Close the descriptors of the fetches that are not local rank `local`'s (None: all of them)."""
    for other, f in fetches.items():
        if other != local:
            for fd in (f["fd"], f["status"]):
                with contextlib.suppress(OSError):
                    os.close(fd)


def preload(args: argparse.Namespace) -> list[str]:
    """Import what the ranks would each import (see the module docstring); the modules imported."""
    if args.no_preload:
        return []
    names = [m for m in MODULES if importlib.util.find_spec(m.split(".")[0]) is not None]
    names += ["reshard.trainer"] if args.module and args.target == TRAINER else []
    for name in [*names, *args.imports]:
        importlib.import_module(name)
    sources = args.preload or [s for s in [trainer_source(args)] if s]
    if sources and "transformers" in sys.modules:
        from reshard.fill.empty_model import import_model_class

        for source in sources:
            try:
                import_model_class(source)
            except ReshardError as e:  # the ranks will say it again, each with its own context
                print(f"{PROG}: warning: --preload {source}: {e}", file=sys.stderr)
    return names


def check_fork_safe() -> None:
    """Refuse to fork after CUDA is initialized; warn about threads (see the module docstring)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise ReshardError("CUDA was initialized before the fork (an --import module used it); a forked rank cannot use "
                           "it. Import such modules in the ranks, after each sets its device")
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        print(f"{PROG}: warning: threads {others} run before the fork; the ranks inherit none of them, and a lock one "
              "holds stays held in every rank", file=sys.stderr)


def run_rank(args: argparse.Namespace, env: dict[str, str], launcher: int) -> None:
    """In the forked child: become rank `env["RANK"]`, run the target as `__main__`, exit. Never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        die_with(launcher)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        gc.enable()
        os.environ.update(env)
        _reseed()
        sys.argv = [args.target, *args.args]
        if args.module:
            sys.path[0] = os.getcwd()
            runpy.run_module(args.target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(args.target))
            runpy.run_path(args.target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
    _finish(code)


def _reseed() -> None:
    """Fresh seeds, as a fresh process draws them: torch's CPU generator and numpy's legacy global one
    (Python's `random` reseeds itself at a fork)."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None:
        torch.default_generator.seed()
    if numpy is not None:
        numpy.random.seed()


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """What the interpreter's exit does (wait for non-daemon threads, atexit, flush), then `_exit`: the
    launcher's own frames above the fork are never unwound in a rank."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # as multiprocessing's forked children do
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


class Ranks:
    """The forked ranks of this node: signals forwarded, the first failure stops the others."""

    def __init__(self, pids: dict[int, int], grace: float) -> None:
        self.live, self.grace = dict(pids), grace  # pid -> global rank
        self.signalled: int | None = None
        self.deadline: float | None = None

    def forward(self, sig: int, frame: Any = None) -> None:
        if frame is not None and self.signalled is None:
            self.signalled = sig
        self.deadline = self.deadline or time.monotonic() + self.grace
        for pid in self.live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)

    def wait(self) -> int:
        """Until every rank has exited; the launcher's exit status."""
        code = 0
        while self.live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self.deadline = float("inf")
                    self.forward(signal.SIGKILL)
                time.sleep(0.02)
                continue
            rank, rc = self.live.pop(pid, None), os.waitstatus_to_exitcode(status)
            if rank is None:
                continue
            status_code = rc if rc >= 0 else 128 - rc
            if status_code and not code and self.signalled is None:
                how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
                print(f"{PROG}: rank {rank} (pid {pid}) {how}; stopping the other {len(self.live)} rank(s)",
                      file=sys.stderr, flush=True)
                code = status_code
                self.forward(signal.SIGTERM)
        return 128 + self.signalled if self.signalled is not None else code


def check_target(args: argparse.Namespace) -> None:
    """Before anything is imported or forked: the script or module exists, and what the trainer or `--preload`
    needs is installed (else each rank would print its own traceback)."""
    if args.module:
        first, sys.path[0] = sys.path[0], os.getcwd()  # where a rank looks for it (`run_rank`, as `python -m`)
        try:
            found = importlib.util.find_spec(args.target) is not None
        except (ImportError, ValueError):  # a parent package that is missing, or an empty name
            found = False
        finally:
            sys.path[0] = first
        if not found:
            raise ReshardError(f"-m {args.target}: no such module here; check its name (and that its package is "
                               "installed or in the current directory)")
    elif not os.path.isfile(args.target):
        raise ReshardError(f"{args.target}: no such script; give the path of a Python file (or -m MODULE)")
    if args.module and args.target == TRAINER:
        require("torch", "transformers", what=f"the trainer ({PROG} -m {TRAINER})")
    elif args.preload and not args.no_preload:
        require("torch", "transformers", what=f"{PROG} --preload")


def launch(args: argparse.Namespace) -> int:
    """Preload, fork `--nproc-per-node` ranks, supervise them; the exit status."""
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ReshardError(f"--nproc-per-node {args.nproc_per_node} --nnodes {args.nnodes} --node-rank "
                           f"{args.node_rank}: need at least one rank and node, and 0 <= node rank < nodes")
    check_target(args)
    enable_import_cache()  # before the preload imports transformers; the ranks inherit what it imported
    os.environ.setdefault(env_name("t0"), repr(time.time()))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does; read by the ranks' thread pools
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without initializing CUDA
    for k in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[k]
    port = args.master_port or (free_port(args.master_addr) if args.nnodes == 1 else 29500)
    fetches = prefetch(args)  # first: the transfers overlap the imports
    gc.disable()  # the imported objects are frozen before the fork: a rank's collections do not copy them
    preload(args)
    check_fork_safe()
    gc.freeze()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else what is buffered would be printed by every rank too
    me, pids = os.getpid(), {}
    for local in range(args.nproc_per_node):
        env = rank_env(args, local, port)
        if local in fetches:
            env[PREFETCH_ENV] = json.dumps({k: v for k, v in fetches[local].items() if k != "pid"})
        pid = os.fork()
        if pid == 0:
            _keep_own(fetches, local)
            run_rank(args, env, me)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also here: a signal forwarded before the child's own setpgid reaches it
        pids[pid] = int(env["RANK"])
    _keep_own(fetches, None)
    gc.enable()
    ranks = Ranks(pids, args.grace)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ranks.forward)
    return ranks.wait()


def cmd_launch(args: argparse.Namespace) -> int:
    return launch(args)


EXAMPLES = ("reshard launch --nproc-per-node 2 -m reshard.cli.train --shards http://127.0.0.1:8000/v1/checkpoints/llama",
            "reshard launch --nproc-per-node 4 --preload shards/ worker.py --steps 10",
            "reshard launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8 train.py")


def add_commands(sub: Any) -> None:
    p = command(sub, "launch", help="start the ranks of a node, forked after importing torch and transformers once "
                "(torchrun's environment)", examples_=EXAMPLES)
    add_arguments(p)
    p.set_defaults(func=cmd_launch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=examples(*EXAMPLES),
                                formatter_class=HelpFormatter)
    add_common_flags(p, top=True)
    add_arguments(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    try:
        return launch(args)
    except ReshardError as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
