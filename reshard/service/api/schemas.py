"""Request and response bodies, for validation and the OpenAPI description at /docs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from reshard.layout.mesh import DIMENSIONS
from reshard.plan.types import MAX_TP
from reshard.service.serve_settings import BOXES_CAP

# checkpoint names and manifest labels as documented in the OpenAPI description (and enforced for JobIn.rules)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$"


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str


class CheckpointSummary(BaseModel):
    name: str
    files: int = Field(description="number of .safetensors files")
    bytes: int = Field(description="their total size")


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointSummary]


class FileOut(BaseModel):
    name: str
    size: int
    mtime_ns: int


class TensorOut(BaseModel):
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    file: str


class MetaFileOut(BaseModel):
    name: str
    size: int
    sha256: str


class MetaList(BaseModel):
    name: str
    files: list[MetaFileOut] = Field(description="the checkpoint's small files (config, tokenizer) it has")


class RulesOut(BaseModel):
    source: str | None = Field(description="where the manifest comes from (stored, rules file, config.json)")
    digest: str | None
    manifest: dict[str, Any] | None
    error: str | None = Field(description="why no manifest applies, when none does")
    stored: list[str] = Field(description="labels of the manifests stored for this checkpoint")


class CheckpointOut(BaseModel):
    name: str
    files: list[FileOut]
    total_bytes: int
    tensors: list[TensorOut]
    config: dict[str, Any] | None
    rules: RulesOut


class RuleIn(BaseModel):
    """One rule: exactly one of `pattern` (glob) or `regex`, a `kind`, and the kind's options."""

    model_config = ConfigDict(extra="allow")

    pattern: str | None = None
    regex: str | None = None
    kind: str


class ManifestIn(BaseModel):
    """A rule manifest (the JSON form of a reshard rules file); first matching rule wins."""

    model_config = ConfigDict(extra="forbid")

    rules: list[RuleIn]
    strict: bool = False
    default: Literal["replicate", "strict", "error"] | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"rules": [r.model_dump(exclude_none=True) for r in self.rules], "strict": self.strict}
        if self.default is not None:
            obj["default"] = self.default
        return obj


class StoredRulesOut(BaseModel):
    name: str
    label: str
    digest: str
    warnings: list[str]
    manifest: dict[str, Any]


class UploadOut(BaseModel):
    name: str
    file: str
    size: int
    sha256: str
    replaced: bool
    tensors: int | None = None
    header_bytes: int | None = None


class RankOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    rank: int
    file: str
    etag: str
    tensors: int | list[dict[str, Any]] = Field(description="the tensors, or their count with tensors=false")
    bytes: int
    replicated_bytes: int
    bytes_read: int
    header_bytes: int


class PlanOut(BaseModel):
    tp: int
    layout: dict[str, int] | None = Field(None, description="the sizes beyond tp (pp, fsdp, ep, dp_replicate), "
                                          "when the layout has any")
    world: int | None = Field(None, description="the number of ranks, when the layout is more than tp")
    plan: str = Field(description="sha256 of source identity, manifest and layout")
    manifest_source: str
    warnings: list[str]
    ranks: list[RankOut]


class DigestOut(BaseModel):
    rank: int
    tp: int
    size: int
    etag: str
    sha256: str
    cached: bool = Field(description="false when this request computed it")


# one field per parallel dimension (`reshard.layout.mesh.DIMENSIONS`): tp, pp, fsdp, ep, dp_replicate
_LayoutFields: Any = create_model(
    "_LayoutFields", __config__=ConfigDict(extra="forbid"),
    **{d.name: (int, Field(d.default, ge=1, le=MAX_TP, strict=True, description=d.help)) for d in DIMENSIONS})


class JobIn(_LayoutFields):
    ranks: list[Annotated[int, Field(ge=0, lt=MAX_TP, strict=True)]] | None = Field(
        None, min_length=1, max_length=MAX_TP, description="default: every rank (global ranks of the layout)")
    rules: str | None = Field(None, description="label of a stored manifest; default: the checkpoint's manifest",
                              pattern=NAME_PATTERN, max_length=128)


class JobOut(BaseModel):
    id: str
    checkpoint: str
    tp: int
    layout: dict[str, int] | None = Field(None, description="the sizes beyond tp, when the layout has any")
    ranks: list[int]
    rules: str | None
    plan: str
    state: Literal["queued", "running", "done", "failed"]
    bytes_done: int
    bytes_total: int
    output_dir: str
    outputs: list[str]
    error: dict[str, str] | None
    created_at: float
    started_at: float | None
    finished_at: float | None


class BoxIn(BaseModel):
    """A block of a tensor: `sizes[d]` indices from `offsets[d]` along each dim d (a 0-d tensor: both empty)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=4096, description="the tensor's name in the checkpoint")
    offsets: list[Annotated[int, Field(ge=0, strict=True)]] = Field(max_length=64, description="first index per dim")
    sizes: list[Annotated[int, Field(ge=0, strict=True)]] = Field(max_length=64, description="length per dim")


class BoxesIn(BaseModel):
    """Boxes of the checkpoint's tensors, answered as one safetensors file (an entry per box)."""

    model_config = ConfigDict(extra="forbid")

    boxes: list[BoxIn] = Field(min_length=1, max_length=BOXES_CAP, description="the boxes (counted before any is "
                               "validated), each answered as an entry named by its tensor (or, where a tensor has "
                               "several, by the tensor's name and the block: NAME[a:b,c:d])")


def inlined_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` put in place (for an OpenAPI request body given by hand)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


class BoxesDigestOut(BaseModel):
    boxes: int
    size: int
    etag: str
    sha256: str
    cached: bool = Field(description="false when this request computed it")
