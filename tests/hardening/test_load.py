"""Load: 32 concurrent clients pull shards, byte ranges, plans and digests of two checkpoints from a real
server for RESHARD_LOAD_SECONDS (default 30; a longer soak by hand: RESHARD_LOAD_SECONDS=600). Every shard is checked against `reshard write`'s output;
no request may fail; the server's memory stays bounded. Run with `-s` to see the figures."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from reshard.format.rank_file import rank_file_name
from tests.support.hard import metric
from tests.support.live import LiveServer

LOAD_SECONDS = float(os.environ.get("RESHARD_LOAD_SECONDS", "30"))
CLIENTS = 32
# 32 streams x ~3 chunks of 256 KiB in flight is ~24 MiB; plans, digests and thread stacks add a few
# MiB more. 128 MiB over the idle server leaves room for allocator slack, not for buffering shards.
RSS_HEADROOM = 128 << 20
CKPTS = {"llama": (1, 2, 4), "qwen2": (1, 2)}

pytestmark = [pytest.mark.servers, pytest.mark.timeout(LOAD_SECONDS + 120)]


@dataclass
class Tally:
    requests: int = 0
    shards: int = 0
    ranges: int = 0
    plans: int = 0
    digests: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, nbytes: int = 0) -> None:
        with self.lock:
            self.requests += 1
            setattr(self, kind, getattr(self, kind) + 1)
            self.bytes += nbytes

    def fail(self, what: str) -> None:
        with self.lock:
            self.requests += 1
            self.errors.append(what)


def _worker(srv: LiveServer, seed: int, want: dict[tuple[str, int, int], bytes], shas: dict[Any, str],
            deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    keys = sorted(want)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        while time.monotonic() < deadline:
            name, tp, rank = rng.choice(keys)
            data = want[(name, tp, rank)]
            url = f"/v1/checkpoints/{name}/shards/{rank}"
            roll = rng.random()
            try:
                if roll < 0.65:
                    r = http.get(url, params={"tp": tp})
                    ok = r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == shas[(name, tp, rank)]
                    kind = "shards"
                elif roll < 0.8:
                    a = rng.randrange(len(data))
                    b = rng.randrange(a, len(data))
                    r = http.get(url, params={"tp": tp}, headers={"Range": f"bytes={a}-{b}"})
                    ok = r.status_code == 206 and r.content == data[a : b + 1]
                    kind = "ranges"
                elif roll < 0.95:
                    r = http.get(f"/v1/checkpoints/{name}/plan", params={"tp": tp, "tensors": rng.random() < 0.5})
                    ranks = r.json()["ranks"] if r.status_code == 200 else []
                    ok = [x["bytes"] for x in ranks] == [len(want[(name, tp, k)]) for k in range(tp)]
                    kind = "plans"
                else:
                    r = http.get(url + "/digest", params={"tp": tp})
                    ok = r.status_code == 200 and r.json()["sha256"] == shas[(name, tp, rank)]
                    kind = "digests"
            except httpx.HTTPError as e:
                tally.fail(f"{name} tp={tp} rank={rank}: {type(e).__name__}: {e}")
                continue
            if ok:
                tally.add(kind, len(r.content))
            else:
                tally.fail(f"{kind} {name} tp={tp} rank={rank}: HTTP {r.status_code}, {len(r.content)} bytes")


def test_32_clients_for_load_seconds(server: LiveServer, written: Any) -> None:
    want = {(name, tp, rank): (written(name, tp) / rank_file_name(rank, tp)).read_bytes()
            for name, tps in CKPTS.items() for tp in tps for rank in range(tp)}
    shas = {key: hashlib.sha256(data).hexdigest() for key, data in want.items()}
    with httpx.Client(base_url=server.url, timeout=60) as http:  # warm the caches, as a running server would be
        for (name, tp, rank) in want:
            assert http.get(f"/v1/checkpoints/{name}/shards/{rank}", params={"tp": tp}).status_code == 200
    rss0 = server.rss()
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            samples.append(server.rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + LOAD_SECONDS
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_worker, server, seed, want, shas, deadline, tally) for seed in range(CLIENTS)]
        for f in futures:
            f.result()
    elapsed = time.monotonic() - t0
    stop.set()
    sampler.join()
    peak = max(samples + [server.rss()])
    print(f"\nload: {CLIENTS} clients x {elapsed:.1f} s: {tally.requests} requests ({tally.requests / elapsed:.0f}/s): "
          f"{tally.shards} shards, {tally.ranges} ranges, {tally.plans} plans, {tally.digests} digests; "
          f"{tally.bytes / 2**20:.0f} MiB ({tally.bytes / 2**20 / elapsed:.1f} MiB/s); errors {len(tally.errors)}; "
          f"server RSS baseline {rss0 / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB "
          f"(+{(peak - rss0) / 2**20:.1f} MiB, bound +{RSS_HEADROOM >> 20} MiB)")
    assert tally.errors == [], tally.errors[:10]
    assert tally.shards > 0 and tally.ranges > 0 and tally.plans > 0 and tally.digests > 0
    assert peak < rss0 + RSS_HEADROOM, (rss0, peak)
    assert metric(server, "reshard_active_streams") == 0
    assert server.alive() and httpx.get(server.url + "/healthz").status_code == 200
