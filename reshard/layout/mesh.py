"""A parallel layout (pp x dp_replicate x fsdp x tp, experts on ep) and what a global rank means in it.

Global rank r means what it means in transformers' device meshes
(`transformers.distributed.utils.initialize_distributed_mesh`):

    dense mesh   ("pp", "dp_replicate", "fsdp", "tp")      row-major: tp varies fastest
    expert mesh  ("pp", "dp_replicate", "efsdp", "ep")     efsdp = fsdp * tp / ep

so a worker launched by torchrun with the same `DistributedConfig` asks for its own rank and gets
its own bytes. The world size is pp * dp_replicate * fsdp * tp. Ranks that differ only in their
dp_replicate coordinate hold identical shards (`Layout.replicas`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from reshard.errors import PlanError

MAX_WORLD = 4096


@dataclass(frozen=True)
class Dim:
    """One parallel dimension: its name (a `Layout` field, a `--flag`, a query parameter, a JSON key),
    what it means, its size when not given, and its place in the mesh order (outermost first)."""

    name: str
    help: str
    mesh: int
    default: int = 1


# THE parallel dimensions: a new one is one entry here (and its field on `Layout`, its math in coords);
# the CLI flags, the service's query parameters and job body, and every listing of sizes come from it
DIMENSIONS = (
    Dim("tp", "tensor-parallel degree", mesh=3),
    Dim("pp", "pipeline stages", mesh=0),
    Dim("fsdp", "FSDP shards of every parameter (dim 0)", mesh=2),
    Dim("ep", "expert-parallel degree (a multiple of tp dividing fsdp x tp)", mesh=4),
    Dim("dp_replicate", "data-parallel replicas (HSDP): identical shards", mesh=1),
)
DIMS = tuple(d.name for d in DIMENSIONS)  # Layout's fields and its JSON keys, in this order
MESH_ORDER = tuple(d.name for d in sorted(DIMENSIONS, key=lambda d: d.mesh))  # dense mesh, then ep


@dataclass(frozen=True)
class Coords:
    """One rank's coordinates on the dense and the expert mesh."""

    rank: int
    pp: int
    dp_replicate: int
    fsdp: int
    tp: int
    efsdp: int
    ep: int


@dataclass(frozen=True)
class Layout:
    """The parallel sizes; each defaults to 1. `Layout(tp=4)` is plain tensor parallelism."""

    tp: int = 1
    pp: int = 1
    fsdp: int = 1
    ep: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or not 1 <= value <= MAX_WORLD:
                raise PlanError(f"{f.name}={value!r} must be an integer from 1 to {MAX_WORLD}")
        if self.world > MAX_WORLD:
            raise PlanError(f"{self.describe()} is a world of {self.world} ranks; at most {MAX_WORLD}")
        if self.ep > 1:
            dense = self.fsdp * self.tp
            if self.ep % self.tp:
                good = [e for e in range(self.tp, dense + 1, self.tp) if dense % e == 0]
                raise PlanError(f"ep={self.ep} is not a multiple of tp={self.tp} (experts are never split by tp "
                                f"under expert parallelism, so each tp group holds whole experts); with fsdp="
                                f"{self.fsdp} x tp={self.tp} pick ep in {{{','.join(map(str, good))}}}")
            if dense % self.ep:
                good = [e for e in range(self.tp, dense + 1, self.tp) if dense % e == 0]
                raise PlanError(f"ep={self.ep} does not divide fsdp x tp = {dense} (the expert mesh spans the same "
                                f"ranks as fsdp x tp); pick ep in {{{','.join(map(str, good))}}} or a larger fsdp")

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.fsdp * self.tp

    @property
    def efsdp(self) -> int:
        """The expert-FSDP size: ranks holding the same experts, FSDP-sharding them."""
        return self.fsdp * self.tp // self.ep

    @property
    def tp_only(self) -> bool:
        return self.world == self.tp and self.ep == 1

    def check_rank(self, rank: Any) -> None:
        if type(rank) is not int or not 0 <= rank < self.world:
            raise PlanError(f"rank={rank!r} is out of range for {self.describe()} (0..{self.world - 1})")

    def coords(self, rank: int) -> Coords:
        """Rank `rank`'s coordinates (row-major on both meshes)."""
        self.check_rank(rank)
        rest, tp = divmod(rank, self.tp)
        rest, fsdp = divmod(rest, self.fsdp)
        pp, dpr = divmod(rest, self.dp_replicate)
        inner = fsdp * self.tp + tp  # the position within (fsdp, tp), which (efsdp, ep) re-reads
        efsdp, ep = divmod(inner, self.ep)
        return Coords(rank, pp, dpr, fsdp, tp, efsdp, ep)

    def replicas(self, rank: int) -> list[int]:
        """The ranks holding the same shard as `rank` (those differing only in dp_replicate)."""
        c = self.coords(rank)
        block = self.fsdp * self.tp
        base = rank - c.dp_replicate * block
        return [base + i * block for i in range(self.dp_replicate)]

    def sizes(self) -> dict[str, int]:
        return asdict(self)

    def given(self) -> dict[str, int]:
        """The sizes other than 1, tp always, in `DIMS` order: how a rank file, a query and the trainer
        state name a layout."""
        return {k: v for k, v in self.sizes().items() if v != 1 or k == "tp"}

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int] | Any) -> Layout:
        """The layout of the dimensions `sizes` names (a mapping, or an object with one attribute per
        dimension: parsed flags, a request body); a dimension it lacks is its default. Other keys are ignored."""
        if not isinstance(sizes, Mapping):
            sizes = {d: getattr(sizes, d) for d in DIMS if hasattr(sizes, d)}
        return cls(**{d.name: sizes.get(d.name, d.default) for d in DIMENSIONS})

    def to_json(self) -> str:
        """The compact JSON a rank file's metadata records (sizes other than 1, in `DIMS` order)."""
        return json.dumps(self.given(), separators=(",", ":"))

    @classmethod
    def from_obj(cls, obj: Any, *, where: str = "layout") -> Layout:
        """A layout from its JSON object (`to_json`) or a dict of sizes; unknown keys are an error."""
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except ValueError:
                raise PlanError(f"{where}: not a JSON object of parallel sizes: {obj[:100]!r}") from None
        if not isinstance(obj, dict) or set(obj) - set(DIMS):
            raise PlanError(f"{where}: expected sizes among {', '.join(DIMS)}, got {obj!r:.200}")
        return cls.from_sizes(obj)

    def _mesh_sizes(self) -> list[tuple[str, int]]:
        """(name, size) in mesh order, those other than 1 (tp always)."""
        return [(k, getattr(self, k)) for k in MESH_ORDER if getattr(self, k) != 1 or k == "tp"]

    def dir_name(self) -> str:
        """A directory name for this layout's rank files: `tp-4`, `pp-2-fsdp-2-tp-2-ep-4`."""
        return "-".join(f"{k}-{v}" for k, v in self._mesh_sizes())

    def describe(self) -> str:
        """`tp=2 x fsdp=2`, the sizes other than 1 (tp always), in mesh order."""
        return " x ".join(f"{k}={v}" for k, v in self._mesh_sizes())


_BEFORE_TP, _AFTER_TP = MESH_ORDER[:MESH_ORDER.index("tp")], MESH_ORDER[MESH_ORDER.index("tp") + 1:]
# what `Layout.dir_name` can give: `tp-2`, `pp-2-fsdp-2-tp-2-ep-4`
_OPTIONAL_AFTER = "".join(rf"(?:-{d}-\d+)?" for d in _AFTER_TP)
DIR_NAME = re.compile(rf"^(?:(?:{'|'.join(_BEFORE_TP)})-\d+-)*tp-\d+{_OPTIONAL_AFTER}$")


def chunk(n: int, parts: int, k: int) -> tuple[int, int]:
    """Part k of `n` indices split as `torch.chunk` (and so DTensor's `Shard`) splits them: parts of
    ceil(n / parts), the last shorter, those past the end empty."""
    size = -(-n // parts) if n else 0
    a = min(k * size, n)
    return a, min(a + size, n)
