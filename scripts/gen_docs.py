"""Regenerate the generated tables of docs/*.md, each between two marker comments:

    <!-- generated: NAME (any note) -->
    ...what GENERATORS[NAME]() returns...
    <!-- end generated -->

    .venv/bin/python scripts/gen_docs.py           # rewrite the tables in docs/*.md
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 if a committed table differs from what this makes

Sources: the service settings class (`reshard.service.serve_settings.Settings`) and the flags of
`reshard serve`; the library's settings class (`reshard.settings.LibrarySettings`, with the service's:
every `RESHARD_*` variable, docs/settings.md); the benchmark results in
`bench/results/` (`quick.json`, `full.json` from `./run bench [--full]`, `stores.md`, `s3_write.md`,
`checkpoint.md`, `dcp_merge.md`, `trainer_support.json`); the plan tests' results `tests/rules/tp_plans/results/coverage.json` (rendered by
`scripts/coverage_table.py`); the side-by-side run with transformers `tests/trainer/results/vs_transformers.json`
(`scripts/vs_transformers.py`, rendered by `scripts/vs_transformers_table.py`). Only the text between the markers is touched.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
if __package__ in (None, "") and str(ROOT) not in sys.path:  # run as `python scripts/gen_docs.py`: for `scripts.*`
    sys.path.insert(0, str(ROOT))

from scripts._generated import write_or_check  # noqa: E402
from scripts.vs_transformers_table import gen_vs_transformers  # noqa: E402

BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z0-9-]+)[^>]*-->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]], align: list[str] | None = None) -> list[str]:
    align = align or ["---"] * len(header)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


# --- service settings ---------------------------------------------------------------------------------

def settings_class() -> type:
    """The service's pydantic Settings."""
    from reshard.service.serve_settings import Settings

    return Settings


def serve_flags() -> dict[str, str]:
    """Settings field -> the `reshard serve` option that sets it (argparse dest = field name)."""
    from reshard.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    serve = sub.choices["serve"]
    return {a.dest: max(a.option_strings, key=len) for a in serve._actions if a.option_strings}  # noqa: SLF001


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << 16 and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    names = {"Path": "path", "str": "string", "int": "integer", "float": "number", "bool": "boolean",
             "SecretStr": "secret string"}
    return names.get(getattr(tp, "__name__", ""), str(tp))


def _bounds(field: Any) -> str:
    out = []
    for m in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sign} {_size(v) if isinstance(v, int) else v}")
    return ", ".join(out)


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "computed at start-up"
    return _value(field.default)


def _value(v: Any) -> str:
    if v is None or v == "":
        return "unset"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, int) and _size(v) != str(v):
        return f"`{v}` ({_size(v)})"
    if isinstance(v, float) and v.is_integer():
        return f"`{int(v)}`"
    return f"`{v}`"


def _settings_rows(cls: type, flags: dict[str, str] | None) -> list[list[str]]:
    prefix = cls.model_config.get("env_prefix", "")
    rows = []
    for name, field in cls.model_fields.items():
        bounds = _bounds(field)
        row = [f"`{prefix}{name.upper()}`", _default(field),
               _type_name(field.annotation) + (f" ({bounds})" if bounds else ""), field.description or ""]
        if flags is not None:
            row.insert(1, f"`{flags[name]}`" if name in flags else "-")
        rows.append(row)
    return rows


def gen_settings() -> str:
    cls = settings_class()
    prefix = cls.model_config.get("env_prefix", "")
    lines = [f"From `{cls.__module__}.{cls.__name__}`: each field is read from the environment variable "
             f"`{prefix}` + its name; the `reshard serve` flag, where there is one, overrides the variable.", ""]
    return "\n".join(lines + _table(["variable", "flag", "default", "type", "what it does"],
                                    _settings_rows(cls, serve_flags())))


def _library_rows() -> list[list[str]]:
    """One row per field of the library's settings (a dataclass: its metadata holds the doc and the bounds)."""
    import dataclasses

    from reshard.settings import LibrarySettings, env_name

    rows = []
    for f in dataclasses.fields(LibrarySettings):
        m = f.metadata
        kind = f"one of {', '.join(f'`{c}`' for c in m['choices'])}" if m["choices"] else _type_name(type(f.default))
        bounds = ", ".join(f"{sign} {m[k]}" for k, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")) if m[k] is not None)
        rows.append([f"`{env_name(f.name)}`", "library", _value(f.default), kind + (f" ({bounds})" if bounds else ""),
                     m["doc"]])
    return rows


def gen_env_vars() -> str:
    """Every `RESHARD_*` variable reshard reads: the library's settings, then the service's."""
    serve = settings_class()
    flags = serve_flags()
    rows = _library_rows()
    for row, name in zip(_settings_rows(serve, None), serve.model_fields, strict=True):
        rows.append([row[0], f"`reshard serve` (`{flags[name]}`)" if name in flags else "`reshard serve`", *row[1:]])
    lines = ["From `reshard.settings.LibrarySettings` (read when used, by every command, the trainer, `fill_model` "
             "and the service, through `library_settings()`) and `reshard.service.serve_settings.Settings` (read "
             "once by `reshard serve`, whose flags override them).", ""]
    return "\n".join(lines + _table(["variable", "read by", "default", "type", "what it does"], rows))


# --- benchmark results ------------------------------------------------------------------------------

def _results(mode: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{mode}.json").read_text(encoding="utf-8"))


def _cases(comp: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The baseline first, then the other cases by name (the JSON keeps its keys sorted)."""
    cases = comp["cases"]
    return [(comp["baseline"], cases[comp["baseline"]])] + sorted((k, v) for k, v in cases.items() if k != comp["baseline"])


def _run_line(results: dict[str, Any], command: str) -> str:
    meta = results["meta"]
    return (f"`{command}` (`bench/results/{meta['mode']}.json`): medians of {meta['reps']} interleaved rounds "
            f"(one-client serving: 7) after {meta.get('warmup', 1)} warm-up round; {meta['machine']}.")


def _comparisons(results: dict[str, Any]) -> list[str]:
    rows = []
    for comp in results["comparisons"]:
        for name, c in _cases(comp):
            server = c.get("watched_peak_rss_anon_mib", {}).get("server")
            rows.append([comp["title"], name, c.get("note", ""), _fmt(c["median_s"], ".3f"),
                         _fmt(c["ratio_to_baseline"], ".2f") + "x", _fmt(c.get("median_mb_s"), ".0f"),
                         _fmt(c["peak_rss_anon_mib"], ".0f"), _fmt(server, ".0f")])
    return _table(["comparison", "command", "what", "median s", "time ratio", "MB/s", "peak RssAnon MiB",
                   "server peak MiB"], rows, ["---", "---", "---", "---:", "---:", "---:", "---:", "---:"])


def gen_bench_quick() -> str:
    r = _results("quick")
    lines = [_run_line(r, "./run bench"), "", *_comparisons(r)]
    train = next((c for c in r["comparisons"] if "ratio_load" in c), None)
    if train:
        d, h, b = train["cases"]["disk"], train["cases"]["http"], train["bytes"]
        lines += ["", f"Trainer start-up at tp={train.get('tp')}, transformers' own model, shards from local files "
                  "or over HTTP from the service:", ""]
        lines += _table(["", "local shards", "over HTTP", "ratio"], [
            ["time to first step, s", _fmt(d["median_time_to_first_step_s"], ".1f"),
             _fmt(h["median_time_to_first_step_s"], ".1f"), _fmt(train["ratio_time_to_first_step"], ".2f") + "x"],
            ["launch until the parameters are filled, s", _fmt(d["median_load_s"], ".1f"),
             _fmt(h["median_load_s"], ".1f"), _fmt(train["ratio_load"], ".2f") + "x"],
            ["bytes received per rank", "-", ", ".join(f"{x / 1e6:.1f} MB" for x in b["http_per_rank"]),
             f"of {b['full'] / 1e6:.1f} MB in the checkpoint; {b['replicated_per_rank'] / 1e6:.2f} MB "
             "of each rank's share is replicated"],
        ])
    return "\n".join(lines)


def gen_bench_full() -> str:
    r = _results("full")
    return "\n".join([_run_line(r, "python -m bench --full"), "", *_comparisons(r)])


def gen_bench_targets() -> str:
    """Each target from the latest run that measured it (quick and full runs measure different cases)."""
    runs = sorted((_results(m) for m in ("quick", "full") if (RESULTS / f"{m}.json").is_file()),
                  key=lambda r: r["meta"]["date"], reverse=True)
    chosen: dict[str, tuple[dict[str, Any], str]] = {}
    for run in runs:
        for t in run.get("targets", []):
            measured = t["value"] != "-"
            if t["target"] not in chosen or (measured and chosen[t["target"]][0]["value"] == "-"):
                chosen[t["target"]] = (t, run["meta"]["mode"])
    order: list[str] = []
    for run in sorted(runs, key=lambda r: -len(r.get("targets", []))):  # merged, each run's order kept
        after = -1
        for t in run.get("targets", []):
            if t["target"] in order:
                after = order.index(t["target"])
            else:
                after += 1
                order.insert(after, t["target"])
    rows = []
    for name in order:
        t, mode = chosen[name]
        met = "-" if t["goal"] == "-" else {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        rows.append([t["target"], t["value"], t["goal"], met, mode if t["value"] != "-" else "-"])
    return "\n".join(_table(["target", "value", "goal", "met", "run"], rows))


def _results_md(name: str) -> str:
    """The caption and tables of a markdown results file; its prose after the last table is history."""
    lines = (RESULTS / name).read_text(encoding="utf-8").splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.startswith("|"))
    out: list[str] = []
    for ln in lines[: last + 1]:
        if ln.startswith("# "):
            out += [f"From `bench/results/{name}`, {ln[2:].strip()}.", ""]
        elif ln.startswith("|"):
            out += [""] if out and out[-1] and not out[-1].startswith("|") else []
            out.append(ln)
        elif ln.strip():
            out.append(ln)
    return "\n".join(out)


def gen_bench_stores() -> str:
    return _results_md("stores.md")


def gen_bench_s3_write() -> str:
    return _results_md("s3_write.md")


def gen_bench_store_serve() -> str:
    return _results_md("store_serve.md")


def gen_bench_direct() -> str:
    return _results_md("direct_reads.md")


def _results_as_written(name: str) -> str:
    """A results file as written, its blank lines kept between its tables, its title as the caption."""
    head, *rest = (RESULTS / name).read_text(encoding="utf-8").rstrip("\n").split("\n")
    return "\n".join([f"From `bench/results/{name}`, {head.removeprefix('# ').strip()}.", *rest])


def gen_bench_checkpoint() -> str:
    """Training checkpoints against torch DCP (bench/compare_checkpoint.py, bench/results/checkpoint.md)."""
    return _results_as_written("checkpoint.md")


def gen_bench_dcp_merge() -> str:
    """`reshard merge` of a DCP checkpoint against torch's and transformers' consolidation
    (bench/compare_dcp_merge.py, bench/results/dcp_merge.md)."""
    return _results_as_written("dcp_merge.md")


def _fill_meta(data: dict[str, Any], name: str) -> str:
    meta = data["meta"]
    return (f"`{meta['command']}` (`bench/results/{name}`, {meta['date']}, commit {meta['git']['commit']}): medians of "
            f"{meta['reps']} interleaved rounds after {meta['warmup']} warm-up round; {meta['machine']}, load average "
            f"{meta['load_at_end']:.1f} at the end.")


def _mib_list(xs: list[Any], scale: float = 1e6, unit: str = "MB") -> str:
    return "/".join(_fmt(x / scale if x is not None else None, ".0f") for x in xs) + f" {unit}" if xs else "-"


def _worker_rows(comp: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, c in _cases(comp):
        rows.append([name, _fmt(c["median_ready_s"], ".2f"), _fmt(c["ratio_to_baseline"], ".2f") + "x",
                     _fmt(c["ratio_to_launch_fp"], ".2f") + ("x" if c["ratio_to_launch_fp"] else ""),
                     _fmt(c["median_load_s"], ".2f"), f"{_fmt(c['median_base_rss_mib'], '.0f')} + {_fmt(c['max_growth_mib'], '.0f')} "
                     f"({_fmt(c['param_mib'], '.0f')})",
                     _mib_list([b for b in c["bytes_per_rank"] if b is not None]) if c["bytes_per_rank"][0] else "-",
                     _mib_list(c["mapped_per_rank"]) if c["mapped_per_rank"][0] else "-", ", ".join(c["verified"]) or "-"])
    return rows


WORKER_HEADER = ["case", "ready s", "x baseline", "x {ref}", "load s", "RSS MiB: base + peak growth (params)",
                 "bytes per rank", "mapped per rank", "verified"]


def gen_bench_fill(name: str = "fill.json") -> str:
    """TP worker and trainer start-up, torchrun vs `reshard launch` (bench/compare_fill.py, bench/results/fill.json)."""
    data = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    lines = [_fill_meta(data, name)]
    for comp in data["comparisons"]:
        if "logits_agree" in comp:
            agree = "agree" if comp["logits_agree"] else "**disagree**"
            lines += ["", f"{comp['title']} (baseline: {comp['baseline']}; logits of every run {agree}):", ""]
            header = [h.format(ref="launch + from_pretrained") for h in WORKER_HEADER]
            lines += _table(header, _worker_rows(comp), ["---"] + ["---:"] * 4 + ["---"] * 4)
        else:
            lines += ["", f"{comp['title']} (`-m reshard.cli.train --steps 1 --dtype keep`, from launch):", ""]
            rows = [[n, _fmt(c["median_time_to_first_step_s"], ".2f"), _fmt(c["median_load_s"], ".2f"),
                     _fmt(c.get("ratio_to_torchrun"), ".2f") + "x" if c.get("ratio_to_torchrun") else "-"]
                    for n, c in _cases(comp)]
            lines += _table(["case", "time to first step s", "model filled s", "x the same under torchrun"], rows)
    rows = [[t["target"], t["value"], t["goal"], {True: "yes", False: "**no**", None: "-"}[t["met"]]]
            for t in data.get("targets", [])]
    issue = "issue 23, item 3" if name == "fill.json" else "issue 35, item 3"
    return "\n".join([*lines, "", f"Targets ({issue}):", "", *_table(["target", "value", "goal", "met"], rows)])


def gen_bench_fill_phases() -> str:
    """A TP worker's start-up per phase under torchrun (bench/fill_phases.py, bench/results/fill_phases.md)."""
    return _results_as_written("fill_phases.md")


def gen_bench_fill_torchrun() -> str:
    """TP worker start-up under plain torchrun, `follow="model"` included (bench/results/fill_torchrun.json)."""
    return gen_bench_fill("fill_torchrun.json")


def gen_bench_link() -> str:
    """A tp=4 group behind a simulated link (bench/compare_link.py, bench/results/link.json)."""
    data = json.loads((RESULTS / "link.json").read_text(encoding="utf-8"))
    comp = data["comparisons"][0]
    rows = [[n, _fmt(c["median_ready_s"], ".2f"), _fmt(c["ratio_to_baseline"], ".2f") + "x",
             _fmt(c["ratio_to_launch_fp"], ".2f") + "x", _fmt((c["median_counted_bytes"] or 0) / 1e9, ".2f")]
            for n, c in _cases(comp)]
    agree = "agree" if comp["logits_agree"] else "**disagree**"
    head = (f"{comp['title']}, checkpoint {comp['checkpoint_bytes'] / 1e9:.2f} GB (logits of every run {agree}):")
    return "\n".join([_fill_meta(data, "link.json"), "", head, "", *_table(
        ["case", "ready s", "x copy + torchrun", "x copy + launch", "GB over the link"], rows,
        ["---", "---:", "---:", "---:", "---:"])])


VLLM_CASES = {"default": "default loader", "reshard_url": "reshard, from the service",
              "reshard_shards": "reshard, rank files"}


def gen_bench_vllm() -> str:
    """vLLM start-up at tp=2, the default loader vs load_format="reshard" (bench/compare_vllm.py,
    bench/results/vllm.json)."""
    data = json.loads((RESULTS / "vllm.json").read_text(encoding="utf-8"))
    meta, full = data["meta"], data["checkpoint_bytes"]
    rows = []
    for name, c in sorted(data["summary"].items(), key=lambda kv: list(VLLM_CASES).index(kv[0]) if kv[0] in VLLM_CASES else 9):
        served = c["served_by_service"]
        read = _mib_list(c["bytes_per_rank"]) + (f" (service: {served / 1e6:.0f} MB for both)" if served else "")
        loads = c["load_s_per_rank"]
        rows.append([VLLM_CASES.get(name, name), _fmt(c["median_ready_s"], ".1f"), ", ".join(f"{x:.1f}" for x in c["ready_s"]),
                     _fmt(c["ratio_ready_to_default"], ".2f") + "x", read,
                     ", ".join(f"{x:.2f}" for x in c["bytes_per_rank_fraction_of_checkpoint"]),
                     f"{loads[0]:.1f}-{loads[-1]:.1f}" if loads else "(not reported by vLLM)"])
    agree = "agree" if data["tokens_agree"] else "**disagree**"
    head = (f"`./run bench-vllm {meta['reps']}` (`bench/results/vllm.json`, {meta['date']}, commit "
            f"{meta['git']['commit']}): medians of {meta['reps']} interleaved rounds after {meta['warmup']} warm-up "
            f"round; {meta['machine'].split(', load average')[0]}; load average {meta['load_average'][0]} at the start, "
            f"{meta['load_average'][1]} at the end. Checkpoint {full / 1e6:.0f} MB; greedy tokens of every run {agree}.")
    return "\n".join([head, "", *_table(["case", "median ready s", "each run s", "x default", "bytes read per rank",
                                         "of the checkpoint", "load step per rank s"], rows,
                                        ["---", "---:", "---", "---:", "---", "---", "---"])])


# --- tests' and trainer results -------------------------------------------------------------------------

def gen_trainer_support() -> str:
    data = json.loads((RESULTS / "trainer_support.json").read_text(encoding="utf-8"))
    rows = []
    for model_type, r in sorted(data["model_types"].items()):
        for case, c in sorted(r["cases"].items()):
            rows.append([model_type, case, "yes" if c.get("moe") else "no", c.get("tp", "-"),
                         _fmt(c.get("max_abs_logit_diff"), ".1e"), "yes" if c.get("supported") else "**no**"])
    head = (f"From `bench/results/trainer_support.json` (`python -m bench.trainer_support`), transformers "
            f"{data.get('transformers', '?')}; check: {data.get('check', '?')}.")
    return "\n".join([head, "", *_table(["model_type", "case", "MoE", "tp", "max abs logit diff", "equal"], rows)])


def gen_coverage() -> str:
    from scripts.coverage_table import RESULTS as COVERAGE
    from scripts.coverage_table import TRAINER, render

    results = json.loads(COVERAGE.read_text(encoding="utf-8"))
    trainer = json.loads(TRAINER.read_text(encoding="utf-8")) if TRAINER.is_file() else None
    return render(results, trainer)


LAYOUTS = ROOT / "tests" / "layout" / "results" / "combinations.json"


def _by_value(archs: dict[str, dict[str, str]], key: str) -> list[tuple[str, list[str]]]:
    """(value, the checkpoints with it) for one field of the per-checkpoint findings, in value order."""
    groups: dict[str, list[str]] = {}
    for arch in archs.values():
        groups.setdefault(arch[key], []).append(arch["label"])
    return sorted((v, sorted(labels)) for v, labels in groups.items())


def gen_layouts() -> str:
    """The layout tests' findings (written with RESHARD_LAYOUTS_OUT=...): per combination and checkpoint,
    whether transformers loads it (else its own error) and what reshard's rank files equal."""
    data = json.loads(LAYOUTS.read_text(encoding="utf-8"))
    rows = []
    for _, c in sorted(data["combinations"].items(), key=lambda kv: (kv[1]["world"], kv[0])):
        sizes = " x ".join(f"{k.removesuffix('_size')}={v}" for k, v in c["sizes"].items())
        loads = _by_value(c["archs"], "transformers")
        if len(loads) == 1:
            cell = "yes" if loads[0][0] == "loads" else f"no: `{loads[0][0]}`"
        else:
            cell = "; ".join(("yes" if v == "loads" else f"no: `{v}`") + f" ({', '.join(labels)})" for v, labels in loads)
        equal = "; ".join(f"{v} ({', '.join(labels)})" for v, labels in _by_value(c["archs"], "reshard"))
        rows.append([sizes, c["world"], cell, equal])
    head = (f"From `tests/layout/results/combinations.json` (`RESHARD_LAYOUTS_OUT=... pytest tests/layout`), "
            f"transformers {data['transformers_version']}.")
    return "\n".join([head, "", *_table(["combination", "ranks", "transformers loads it", "reshard's rank files"], rows)])


GENERATORS: dict[str, Callable[[], str]] = {
    "layouts": gen_layouts,
    "settings": gen_settings,
    "env-vars": gen_env_vars,
    "bench-quick": gen_bench_quick,
    "bench-full": gen_bench_full,
    "bench-targets": gen_bench_targets,
    "bench-stores": gen_bench_stores,
    "bench-s3-write": gen_bench_s3_write,
    "bench-store-serve": gen_bench_store_serve,
    "bench-direct": gen_bench_direct,
    "bench-checkpoint": gen_bench_checkpoint,
    "bench-dcp-merge": gen_bench_dcp_merge,
    "bench-fill": gen_bench_fill,
    "bench-fill-torchrun": gen_bench_fill_torchrun,
    "bench-fill-phases": gen_bench_fill_phases,
    "bench-link": gen_bench_link,
    "bench-vllm": gen_bench_vllm,
    "trainer-support": gen_trainer_support,
    "coverage": gen_coverage,
    "vs-transformers": gen_vs_transformers,
}


def generated(text: str, *, where: str = "text") -> str:
    """`text` with every generated block replaced by what its generator makes now."""
    cache: dict[str, str] = {}

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"{where}: unknown generated block {name!r}; known: {', '.join(GENERATORS)}")
        if name not in cache:
            cache[name] = GENERATORS[name]().rstrip("\n") + "\n"
        return m.group(1) + cache[name] + m.group(4)

    return BLOCK.sub(fill, text)


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page's generated tables are not current")
    args = parser.parse_args(argv)
    rc = 0
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if not BLOCK.search(text):
            continue
        rc |= write_or_check(page, generated(text, where=str(page)), check=args.check,
                             done=f"{page.relative_to(ROOT)}: generated tables written")
    return rc


if __name__ == "__main__":
    sys.exit(main())
