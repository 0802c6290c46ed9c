"""`FillReport`: what a fill did (`fill_model` from a rank's shard, or from boxes the model's tensors hold)."""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard.layout.mesh import Layout

__all__ = ["FillReport"]


@dataclass
class FillReport:
    """What `fill_model` did: tensors filled (per-expert ones into fused parameters counted apiece),
    bytes pulled (the whole rank file, or the boxes' answer), seconds, and name -> (shard dtype, parameter dtype) casts."""

    source: str
    rank: int
    tp: int
    tensors: int
    bytes: int
    seconds: float
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)
    fused: int = 0
    layout: Layout | None = None
    mapped: int = 0  # bytes bound to the rank file's mapping, not copied (reshard.fill.mapped_params)
    verified: str = "none"  # sha256 (hashed), identity (unchanged since verified), none (no digest recorded)
    follow: str = "shard"  # what decided the bytes: the rank's shard, or the model's tensors ("model": boxes)

    def __str__(self) -> str:
        casts = sorted({f"{a}->{b}" for a, b in self.casts.values()})
        cast = f"; cast {len(self.casts)} tensors ({', '.join(casts)})" if casts else ""
        fused = f" ({self.fused} per-expert tensors into fused parameters)" if self.fused else ""
        mapped = f", {self.mapped / 1e6:.1f} MB of it mapped" if self.mapped else ""
        mapped += ", the blocks the model's tensors hold" if self.follow == "model" else ""
        return (f"filled {self.tensors} tensors{fused}, {self.bytes / 1e6:.1f} MB from {self.source}{mapped} "
                f"(rank {self.rank} of {(self.layout or Layout(tp=self.tp)).describe()}) in {self.seconds:.2f} s"
                f"{cast}; verified: {self.verified}")
