"""Results out: one JSON, a PNG chart of the ratios, and a markdown summary table (also printed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (comparison, case)."""
    out = []
    for comp in results.get("comparisons", []):
        for name, c in comp["cases"].items():
            server = c.get("watched_peak_rss_anon_mib", {})
            out.append({
                "comparison": comp["title"], "case": name, "median_s": c["median_s"],
                "ratio": c["ratio_to_baseline"], "baseline": comp["baseline"],
                "peak_mib": c["peak_rss_anon_mib"], "server_mib": server.get("server"),
                "note": c.get("note", ""), "mb_s": c.get("median_mb_s"),
            })
    return out


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"Benchmark `{meta['mode']}` mode, {meta['date']}, {meta['machine']}.",
        f"Code: {meta.get('git', {}).get('commit', '?')}"
        + (f" plus uncommitted changes to {', '.join(meta['git']['uncommitted'])}" if meta.get("git", {}).get("uncommitted") else "")
        + ".",
        f"Medians of {meta['reps']} (serve, 1 client: 7) interleaved runs after a warm-up; ratio = median of per-round ratios to the "
        "comparison's baseline (first row of each block, ratio 1.00). Inputs read from the page cache "
        "(warm-up run; caches not dropped). Peak RssAnon summed over the command's process tree"
        " (server: the server's tree during the run).",
        "",
        "| comparison | command | median s | ratio | peak RssAnon MiB | server peak MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows(results):
        lines.append(f"| {r['comparison']} | {r['case']} | {_fmt(r['median_s'], '.3f')} | {_fmt(r['ratio'])}x | "
                     f"{_fmt(r['peak_mib'], '.0f')} | {_fmt(r['server_mib'], '.0f')} |")
    extra = results.get("memory")
    if extra and extra.get("peak_rss_anon_mib"):
        peaks = ", ".join(f"{k}: {v:.0f} MiB" for k, v in extra["peak_rss_anon_mib"].items())
        growth = extra.get("growth_1gb_to_4gb")
        lines += ["", f"Peak RssAnon of `reshard write --tp 4`: {peaks}"
                  + (f"; growth 1 GB -> 4 GB: {growth * 100:+.1f}%" if growth is not None else "") + "."]
    for comp in results.get("comparisons", []):
        if "ratio_load" in comp:
            d, h = comp["cases"]["disk"], comp["cases"]["http"]
            b = comp["bytes"]
            lines += ["", f"Trainer start-up (tp={comp.get('tp')}): time to first step {h['median_time_to_first_step_s']:.1f} s "
                      f"over HTTP vs {d['median_time_to_first_step_s']:.1f} s from local shards (ratio "
                      f"{comp['ratio_time_to_first_step']:.2f}x); launch until the parameters are filled "
                      f"{h['median_load_s']:.1f} s vs {d['median_load_s']:.1f} s ({comp['ratio_load']:.2f}x). Bytes "
                      f"per rank over HTTP: {', '.join(f'{x / 1e6:.1f} MB' for x in b['http_per_rank'])} (plan: "
                      f"{', '.join(f'{x / 1e6:.1f} MB' for x in b['plan_per_rank'])}, of which "
                      f"{b['replicated_per_rank'] / 1e6:.2f} MB replicated; the full checkpoint is {b['full'] / 1e6:.1f} MB; "
                      f"the service counted {b['served_by_service_per_run'][-1] / 1e6:.1f} MB sent per run, all ranks). "
                      f"Warm-up: {comp.get('warmup', 'one untimed round')}."]
        if "fill_ratio_ready" in comp:  # bench/compare_fill.py
            t, f, b = comp["cases"]["from_pretrained"], comp["cases"]["fill_model"], comp["bytes"]
            lines += ["", f"TP worker start-up (tp={comp.get('tp')}): ready {f['median_ready_s']:.1f} s with "
                      f"`empty_tp_model` + `fill_model` from the service vs {t['median_ready_s']:.1f} s with "
                      f"`from_pretrained(tp_plan=\"auto\")` ({comp['fill_ratio_ready']:.2f}x; loading alone "
                      f"{f['median_load_s']:.1f} s vs {t['median_load_s']:.1f} s, {comp['fill_ratio_load']:.2f}x). Bytes per "
                      f"rank pulled: {', '.join(f'{x / 1e6:.1f} MB' for x in b['fill_pulled_per_rank'])} "
                      f"(service counted {b['served_by_service_per_run'][-1] / 1e6:.1f} MB a run, all ranks), vs the "
                      f"{b['from_pretrained_mapped_per_rank'] / 1e6:.1f} MB checkpoint each `from_pretrained` rank maps. "
                      f"Logits agree: {comp['logits_agree']}."]
    if results.get("targets"):
        lines += ["", *targets_table(results["targets"])]
    return "\n".join(lines) + "\n"


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of a targets table (bench.targets' rows)."""
    lines = ["| target | value | goal | met |", "|---|---|---|---|"]
    for t in targets:
        met = "-" if t["goal"] == "-" else {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['value']} | {t['goal']} | {met} |")
    return lines


def write_md_json(out: Path, text: str, results: dict[str, Any]) -> None:
    """A standalone comparison's results: `out` (markdown, also printed) and the JSON beside it."""
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    print(text)


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = results.get("comparisons", [])
    if not comps:
        return
    fig, axes = plt.subplots(len(comps), 1, figsize=(9, 1.2 + 0.42 * sum(len(c["cases"]) for c in comps)
                                                         + 0.6 * len(comps)), squeeze=False)
    for ax, comp in zip(axes[:, 0], comps):
        names = list(comp["cases"])
        ratios = [comp["cases"][n]["ratio_to_baseline"] for n in names]
        ratios = [0.0 if r is None or math.isnan(r) else r for r in ratios]
        colors = ["#888888" if n == comp["baseline"] else ("#2b6cb0" if "reshard" in n or n == "http" else "#dd8452") for n in names]
        ax.barh(names[::-1], ratios[::-1], color=colors[::-1])
        ax.axvline(1.0, color="black", lw=0.8)
        for y, (n, r) in enumerate(zip(names[::-1], ratios[::-1])):
            ax.text(r, y, f" {r:.2f}x  ({comp['cases'][n]['median_s']:.2f} s)", va="center", fontsize=7)
        ax.set_title(f"{comp['title']} (time / {comp['baseline']}; lower is better)", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, max(ratios + [1.0]) * 1.35)
    fig.suptitle(f"reshard bench ({results['meta']['mode']}, {results['meta']['date']})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = results["meta"]["mode"]
    paths = {"json": out_dir / f"{mode}.json", "png": out_dir / f"{mode}.png", "md": out_dir / f"{mode}.md"}
    paths["json"].write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    paths["md"].write_text(markdown(results))
    chart(results, paths["png"])
    return paths
