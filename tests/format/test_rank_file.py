"""`reshard.format.rank_file` is the one owner of the rank-file format: no other module of reshard/ spells
its version, its file name or the keys it writes into `__metadata__`; what it encodes is what
safetensors reads back from a file `reshard write` made, and decodes to the same values; the planner's
fast header encoder gives the bytes the plain `json.dumps` encoding gives."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.cli import main
from reshard.errors import CheckpointError
from reshard.format.checkpoint import encode_header
from reshard.format.rank_file import (
    FORMAT,
    HeaderEncoder,
    RankPlace,
    dcp_fragment,
    decode_metadata,
    describe_tensor,
    encode_metadata,
    header_prefix,
    parse_rank_file_name,
    plan_identity,
    rank_file_name,
    rule_json,
    tensor_json,
)
from reshard.layout import Layout
from reshard.layout.placement import describe_layout
from reshard.testing.synth import make_checkpoint, preset_config

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2] / "reshard"
OWNER = ROOT / "format" / "rank_file.py"
KEYS = {"format", "coords", "tensors", "layout", "tp", "rank"}  # what `__metadata__` of a rank file holds
NAME_PATTERNS = [re.escape(FORMAT), r"[\"']rank-\{", r"[\"']rank-\(\\d", r"[\"']rank-\*"]  # the name begins a string


def offences(source: str) -> list[str]:
    """Where `source` writes rank-file metadata or spells the format's version or file name: a dict
    display with a "format" key and another key of the metadata, a store to `x["format"]` or
    `x["coords"]`, a `__metadata__` dict display, or the version/file-name patterns."""
    found = [f"pattern {p}" for p in NAME_PATTERNS if re.search(p, source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if "__metadata__" in keys or ("format" in keys and keys & (KEYS - {"format", "tp"})):
                found.append(f"line {node.lineno}: a dict of {sorted(keys)}")
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.slice, ast.Constant) and node.slice.value in ("format", "coords"):
            found.append(f"line {node.lineno}: a store to [{node.slice.value!r}]")
    return found


def test_the_scan_finds_a_second_writer() -> None:
    """The scan below is not vacuous: each way of writing the metadata elsewhere is caught."""
    assert offences('meta = {"format": "x", "tp": "2", "rank": "0"}')
    assert offences('meta["coords"] = "{}"')
    assert offences('head = {"__metadata__": meta}')
    assert offences('name = f"rank-{rank:05d}-of-{world:05d}.safetensors"')
    assert offences(f"v = {FORMAT!r}")
    assert offences('RANK = re.compile(r"rank-(\\d{5})")')
    assert offences('have = root.glob("rank-*")')
    assert not offences('identity = {"source": s, "tp": 2, "format": FORMAT}\nentry = {"rank": 0, "tensors": []}\n'
                        'fd = memfd_create(f"reshard-rank-{rank}")')


def test_one_module_writes_the_rank_file_format() -> None:
    """Only `reshard/format/rank_file.py` writes `__metadata__` keys, `FORMAT`'s value and the file
    name pattern (safetensors' own header encoding, `format/headers.py`, writes the generic `__metadata__`)."""
    sources = sorted(p for p in ROOT.rglob("*.py") if p not in (OWNER, ROOT / "format" / "headers.py"))
    assert len(sources) > 100
    bad = {str(p.relative_to(ROOT)): o for p in sources if (o := offences(p.read_text()))}
    assert bad == {}
    assert offences(OWNER.read_text())  # the owner does all of it


def test_file_names() -> None:
    assert rank_file_name(3, 16) == "rank-00003-of-00016.safetensors"
    assert parse_rank_file_name("rank-00003-of-00016.safetensors") == (3, 16)
    for other in ("rank-3-of-16.safetensors", "rank-00003-of-00016.safetensors.tmp", "model.safetensors"):
        assert parse_rank_file_name(other) is None


@pytest.mark.parametrize("args", [["--tp", "2"], ["--tp", "2", "--pp", "2"]], ids=["tp2", "tp2-pp2"])
def test_round_trip_through_reshard_write(tmp_path: Path, args: list[str]) -> None:
    """What `reshard write` put on disk, read by safetensors' `safe_open(...).metadata()`, is exactly
    `encode_metadata` of what `decode_metadata` gives back, and decodes to the file's place."""
    make_checkpoint(tmp_path / "tiny", preset_config("tiny"))
    assert main(["write", str(tmp_path / "tiny"), *args, "-o", str(tmp_path / "out")]) == 0
    layout = Layout(tp=2, pp=2) if "--pp" in args else Layout(tp=2)
    plans, described = set(), {}
    for rank in range(layout.world):
        path = tmp_path / "out" / rank_file_name(rank, layout.world)
        with safe_open(str(path), "np") as f:
            on_disk, names = f.metadata(), sorted(f.keys())
        got = decode_metadata(on_disk, str(path))
        assert (got.tp, got.rank, sorted(got.tensors)) == (2, rank, names)
        assert describe_layout(got, str(path)) == layout
        if layout.tp_only:
            assert (got.layout, got.coords) == (None, None)
            assert sorted(on_disk) == ["DCP_SHARDING_INFO", "DCP_VERSION", "format", "plan", "rank", "tensors", "tp"]
        else:
            assert got.layout == {"tp": 2, "pp": 2}  # ranks 0-1 are stage 0, 2-3 stage 1; without ep the
            # expert mesh re-reads (fsdp, tp) as (efsdp, ep=1)
            assert got.coords == {"pp": rank // 2, "dp_replicate": 0, "fsdp": 0, "tp": rank % 2, "efsdp": rank % 2, "ep": 0}
        assert on_disk["format"] == FORMAT
        assert encode_metadata(RankPlace(got.tp, got.rank, got.layout, got.coords, got.plan), got.tensors) == on_disk
        shapes = {d["shape"][0] for d in got.tensors.values()}
        assert max(shapes) > 1
        plans.add(got.plan)
        described.update({n: (d["shape"], rule_json(d["kind"], d.get("options"))) for n, d in got.tensors.items()})
    # one identity in every file: the layout and every tensor's (name, shape, kind, options), all ranks' together
    assert plans == {plan_identity(layout.given(), [(n, s, r) for n, (s, r) in described.items()])}


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "np") as f:
        return dict(f.metadata())


def _rewrite(src: Path, dst: Path, rank: int, *, keep_plan: bool, rename: str = "") -> None:
    """Rank `rank` of tp=2 in `src` saved again into `dst` by safetensors: without its plan identity (a
    file of header revision 2) or, with `rename`, every tensor renamed NAME + rename (an optimizer's files:
    their parameters' identity kept)."""
    name = rank_file_name(rank, 2)
    meta, tensors = _metadata(src / name), load_file(src / name)
    if not keep_plan:
        del meta["plan"]
    if rename:
        tensors = {n + rename: t for n, t in tensors.items()}
        for key in ("tensors", "DCP_SHARDING_INFO"):  # as the format writes them: compact, sorted keys
            meta[key] = json.dumps({n + rename: d for n, d in json.loads(meta[key]).items()}, separators=(",", ":"),
                                   sort_keys=True)
    dst.mkdir(exist_ok=True)
    save_file(tensors, str(dst / name), meta)


def test_rank_files_planned_again_at_their_own_layout_record_their_own_plan(tmp_path: Path) -> None:
    """Written again at their own layout, rank files are the same files, the plan identity they record
    included (none for files older than it, their parameters' for an optimizer's files): so the digests
    recorded of them still hold for the service's answer. At another layout the plan is a new one, the
    identity that of a write from the HF checkpoint."""
    make_checkpoint(tmp_path / "tiny", preset_config("tiny"))
    assert main(["write", str(tmp_path / "tiny"), "--tp", "2", "-o", str(tmp_path / "tp2")]) == 0
    assert main(["write", str(tmp_path / "tp2"), "--tp", "2", "-o", str(tmp_path / "again")]) == 0
    for rank in range(2):
        assert (tmp_path / "again" / rank_file_name(rank, 2)).read_bytes() == (tmp_path / "tp2" / rank_file_name(rank, 2)).read_bytes()
    for variant, kw in {"old": {"keep_plan": False}, "moments": {"keep_plan": True, "rename": ".exp_avg"}}.items():
        for rank in range(2):
            _rewrite(tmp_path / "tp2", tmp_path / variant, rank, **kw)
        assert main(["write", str(tmp_path / variant), "--tp", "2", "-o", str(tmp_path / f"{variant}-again")]) == 0
        for rank in range(2):
            name = rank_file_name(rank, 2)
            got, want = _metadata(tmp_path / f"{variant}-again" / name), _metadata(tmp_path / variant / name)
            assert got == want and ("plan" in got) == kw["keep_plan"], variant
            assert all(torch.equal(load_file(tmp_path / f"{variant}-again" / name)[n], t)
                       for n, t in load_file(tmp_path / variant / name).items())
    assert main(["write", str(tmp_path / "old"), "--tp", "4", "-o", str(tmp_path / "old-tp4")]) == 0
    assert main(["write", str(tmp_path / "tiny"), "--tp", "4", "-o", str(tmp_path / "tp4")]) == 0
    for rank in range(4):
        name = rank_file_name(rank, 4)
        assert (tmp_path / "old-tp4" / name).read_bytes() == (tmp_path / "tp4" / name).read_bytes()


def test_decode_refuses_what_is_not_a_rank_file() -> None:
    good = encode_metadata(RankPlace(2, 1), {"w": describe_tensor("column", (4, 2), (((2, 4),), ((0, 2),)))})
    assert decode_metadata(good, "f").tensors == {"w": {"kind": "column", "shape": [4, 2], "select": [[[2, 4]], [[0, 2]]]}}
    cases = [({"format": "pt"}, "f: not a reshard rank file (metadata format 'pt', expected 'reshard.rank/1')"),
             ({**good, "rank": "one"}, "f: metadata has no rank"),
             ({**good, "tensors": '{"w": {"kind": "column"}}'}, "f: metadata `tensors` is missing or malformed"),
             ({**good, "layout": "[2]"}, "f: metadata `layout`: not a JSON object: '[2]'"),
             ({**good, "plan": "../x"}, "f: metadata `plan`: not a plan identity (32 hex digits): '../x'")]
    for meta, message in cases:
        with pytest.raises(CheckpointError) as e:
            decode_metadata(meta, "f")
        assert str(e.value) == message


@pytest.mark.parametrize("place", [RankPlace(4, 3), RankPlace(2, 5, {"tp": 2, "pp": 4}, {"pp": 2, "tp": 1}, "0" * 32)],
                         ids=["tp", "layout"])
def test_fast_header_is_json_dumps(place: RankPlace) -> None:
    """`HeaderEncoder` (the planner's path) gives the bytes of `encode_header(encode_metadata(...))`, the
    plain `json.dumps` of the whole header, names that need escaping, several item sizes and tensors with
    and without a DCP_SHARDING_INFO entry (one box; padded past the global size; two blocks) included."""
    tensors = {"b.w": ("F32", (4, 6)), 'a"q\\u\u00e9': ("BF16", (3,)), "c": ("I8", (2, 2)), "d": ("F32", (0,)),
               "e": ("F32", (2, 3))}
    descriptions = {n: describe_tensor("column", (8, *shape[1:]), tuple(((1, 1 + s),) for s in shape),
                                       {"pad": 1} if n == "c" else None) for n, (_, shape) in tensors.items()}
    descriptions["e"] = describe_tensor("packed_column", (8, 3), (((0, 1), (4, 5)), ((0, 3),)), {"blocks": [4, 4]})
    names = sorted(tensors)
    ordered = sorted(names, key=lambda n: ({"F32": -4, "BF16": -2, "I8": -1}[tensors[n][0]], n))
    entries, pos = [], 0
    for n in ordered:
        dtype, shape = tensors[n]
        size = {"F32": 4, "BF16": 2, "I8": 1}[dtype] * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        entries.append((n, dtype, shape, pos, pos + size))
        pos += size
    want = encode_header(encode_metadata(place, descriptions), entries)
    enc = HeaderEncoder(names, ordered)
    body = enc.entries([enc.entry_head(dtype, shape) for _, dtype, shape, _, _ in entries],
                       [str(b) for *_, b, _ in entries], [str(e) for *_, e in entries])
    got = enc.header(header_prefix(place), [enc.escape(tensor_json(descriptions[n])) for n in names], body,
                     [enc.escape(dcp_fragment(descriptions[n])) for n in names])
    assert got == want
    meta = json.loads(got[8:])["__metadata__"]
    assert meta["tensors"] == json.dumps(descriptions, separators=(",", ":"), sort_keys=True)
    # torch's reader: every tensor that is one box of its global tensor, at the box's starts
    assert json.loads(meta["DCP_SHARDING_INFO"]) == {'a"q\\u\u00e9': {"saved_offsets": [1]}, "d": {"saved_offsets": [1]}}
    assert meta["DCP_VERSION"] == "1.0"
    assert HeaderEncoder([], []).header(header_prefix(place), [], "", []) == encode_header(encode_metadata(place, {}), [])
