"""Real runs, `full` against `sync`, back to back on this machine: the issue-9 check that the techniques
win for real, not only in the simulator.

    python -m benchmarks.real_pairs [--pairs 3] [--batches 6] [--out docs/runs] [--config FILE]
    python -m benchmarks.real_pairs --replot docs/runs/pairs.json   (redraw the plot only)

Each pair is `corral run --policy full --batches N --json OUT/pairI-full.json`, then the same with
`--policy sync`, on the default config (or `--config`). Every figure comes from the runs' own reports:
mean and p90 batch collection time, the ratio sync/full of the means (> 1 means `full` was faster), and
what each trainer waited on (`wait_attribution`). It prints a table and the median ratio, and writes
OUT/pairs.json (the summary) and OUT/pairs.png (mean batch collection time per pair). The load average
before each run is recorded: on a shared machine a pair is only comparable when both runs saw the same.

A fast batch is worth nothing if hard tasks never make it in, so each run also reports its discarded
groups by reason and detail (e.g. `failed: task X: set-up timed out`), how many groups of each task its
batches held, the tasks admitted that never reached a batch, and each task's reset times (median, max).

With `--variant LABEL=CONFIG` each pair also runs `full` under CONFIG after the other two (for one
setting against the default, e.g. `--variant fifo=docs/runs/stop34/fifo.yaml`): the summary gives
the ratio variant/full of the means per pair (> 1 means the default config was faster) and its median.

Ctrl-C stops the run in progress (it still writes its report) and summarises the runs that finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

POLICIES = ("full", "sync")


def run_one(policy: str, batches: int, report: Path, config: Path | None, label: str) -> dict[str, Any]:
    argv = [sys.executable, "-c", "from app.cli import main; main()", "run", "--policy", policy,
            "--batches", str(batches), "--json", str(report)]  # fmt: skip
    if config is not None:
        argv += ["--config", str(config)]
    load = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            print(f"  [{label} {policy}] {line.rstrip()}", flush=True)
        code = proc.wait()
    except KeyboardInterrupt:
        code = proc.wait()  # the child got the same Ctrl-C: it ends its step and writes its report
    wall = time.monotonic() - started
    if not report.exists():
        return {"policy": policy, "exit_code": code, "error": "no report written"}
    data = json.loads(report.read_text())
    collection = data["batch_collection_s"]
    return {
        "policy": policy,
        "report": str(report),
        "exit_code": code,
        "batches": data["batches"],
        "mean_s": collection["mean"],
        "p90_s": collection["p90"],
        "per_batch_s": collection["per_batch"],
        "lower_bound_s": data.get("lower_bound_s"),
        "waited": data["wait_attribution"]["summary"],
        "lost_groups": data["lost_groups"],
        **batch_makeup(data),
        "load_before": round(load, 2),
        "wall_s": round(wall, 1),
    }


def batch_makeup(data: dict[str, Any]) -> dict[str, Any]:
    """What the run's batches held and what it discarded, from its report: discarded groups by reason
    and detail, groups of each task delivered in a batch, tasks admitted but never delivered, and the
    reset (set-up) wall times of each task."""
    out: dict[str, Any] = {
        "discarded": data.get("discarded_groups", {}),
        "discard_details": data.get("discard_details", {}),
    }
    names: dict[str, str] | None = data.get("group_tasks")
    if names is None:  # a report from before corral run named each group's task
        return out
    delivered = data.get("tasks_by_outcome", {}).get("delivered", {})
    out["tasks_in_batches"] = delivered
    out["tasks_never_in_a_batch"] = sorted(set(names.values()) - set(delivered))
    resets: dict[str, list[float]] = {}
    for ev in data.get("event_log", []):
        if ev.get("kind") == "sandbox_op" and ev.get("lane") == "reset" and ev.get("ok"):
            task = names.get(str(ev.get("group_id")))
            if task is not None:
                resets.setdefault(task, []).append(ev["end"] - ev["start"])
    out["reset_s_by_task"] = {
        task: {"n": len(times), "median": round(statistics.median(times), 2), "max": round(max(times), 2)}
        for task, times in sorted(resets.items())
    }
    return out


def describe_run(label: str, run: dict[str, Any]) -> list[str]:
    """Lines on what a run's batches held and what it lost, for the printed summary."""
    failed = run.get("discard_details", {}).get("failed", {})
    lines = [f"{label}: discarded {run.get('discarded', {})}"]
    lines += [f"  failed x{n}: {detail}" for detail, n in sorted(failed.items())]
    if "tasks_in_batches" in run:
        held = ", ".join(f"{task} x{n}" for task, n in run["tasks_in_batches"].items())
        lines.append(f"  in batches: {held}")
        lines.append(f"  never in a batch: {', '.join(run['tasks_never_in_a_batch']) or 'none'}")
    return lines


def summarise(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    complete = [p for p in pairs if all(p.get(k, {}).get("mean_s") for k in POLICIES)]
    for pair in complete:
        pair["ratio_sync_over_full"] = round(pair["sync"]["mean_s"] / pair["full"]["mean_s"], 3)
    ratios = [p["ratio_sync_over_full"] for p in complete]
    summary = {
        "pairs": pairs,
        "median_ratio_sync_over_full": statistics.median(ratios) if ratios else None,
        "full_faster_in": sum(r > 1 for r in ratios),
        "complete_pairs": len(complete),
    }
    with_variant = [
        p for p in pairs if p.get("variant", {}).get("mean_s") and p.get("full", {}).get("mean_s")
    ]
    for pair in with_variant:
        pair["ratio_variant_over_full"] = round(pair["variant"]["mean_s"] / pair["full"]["mean_s"], 3)
    if with_variant:
        variant_ratios = [p["ratio_variant_over_full"] for p in with_variant]
        summary["variant"] = with_variant[0]["variant"]["label"]
        summary["median_ratio_variant_over_full"] = statistics.median(variant_ratios)
        summary["full_faster_than_variant_in"] = sum(r > 1 for r in variant_ratios)
    return summary


def variant_arg(text: str) -> tuple[str, Path]:
    """`LABEL=CONFIG` for `--variant`: a config file that exists, under a label."""
    label, sep, config = text.partition("=")
    if not sep or not label or not config:
        raise argparse.ArgumentTypeError(f"expected LABEL=CONFIG, got {text!r}")
    if not Path(config).is_file():
        raise argparse.ArgumentTypeError(f"no config file at {config}")
    return label, Path(config)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in summary["pairs"] if "ratio_sync_over_full" in p]
    if not pairs:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    xs = range(len(pairs))
    shown = [*POLICIES, *(["variant"] if all("ratio_variant_over_full" in p for p in pairs) else [])]
    width = 0.76 / len(shown)
    colours = {"full": "#2a7", "sync": "#c74", "variant": "#58c"}
    for i, policy in enumerate(shown):
        offset = (i - (len(shown) - 1) / 2) * width
        means = [p[policy]["mean_s"] for p in pairs]
        p90s = [p[policy]["p90_s"] for p in pairs]
        name = f"full ({pairs[0]['variant']['label']})" if policy == "variant" else policy
        xs_here = [x + offset for x in xs]
        ax.bar(xs_here, means, width=width * 0.95, color=colours[policy], label=f"{name} mean")
        label = "p90" if i == len(shown) - 1 else None
        ax.scatter([x + offset for x in xs], p90s, color="black", marker="_", s=200, zorder=3, label=label)
    ax.set_xticks(list(xs), [f"pair {p['pair']}\n{p['ratio_sync_over_full']:.2f}×" for p in pairs])
    top = max(p[policy]["p90_s"] for p in pairs for policy in shown)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel("batch collection time (s)")
    ax.set_title("real corral runs, back to back: sync/full under each pair", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replot", type=Path, metavar="PAIRS_JSON", help="only redraw the plot of a summary")
    parser.add_argument("--pairs", type=int, default=3, choices=range(1, 21), metavar="1..20")
    parser.add_argument("--batches", type=int, default=6, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--out", type=Path, default=Path("docs/runs"))
    parser.add_argument("--prefix", default="pair")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument(
        "--variant", type=variant_arg, metavar="LABEL=CONFIG", help="also run full under CONFIG in each pair"
    )
    args = parser.parse_args()
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    if args.config is not None and not args.config.is_file():
        sys.exit(f"real_pairs: no config file at {args.config}")
    from benchmarks import check_outputs, save_json, save_plot  # as a script (-m), the package is importable

    check_outputs(out=args.out / f"{args.prefix}s.json")  # before any run: the summary goes there
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: list[dict[str, Any]] = []
    try:
        for i in range(1, args.pairs + 1):
            pair: dict[str, Any] = {"pair": i}
            pairs.append(pair)
            for policy in POLICIES:
                print(f"pair {i}/{args.pairs}: {policy}", flush=True)
                report = args.out / f"{args.prefix}{i}-{policy}.json"
                pair[policy] = run_one(policy, args.batches, report, args.config, f"{i}/{args.pairs}")
            if args.variant is not None:
                label, config = args.variant
                print(f"pair {i}/{args.pairs}: full ({label})", flush=True)
                report = args.out / f"{args.prefix}{i}-full-{label}.json"
                run = run_one("full", args.batches, report, config, f"{i}/{args.pairs} {label}")
                pair["variant"] = {"label": label, "config": str(config), **run}
    except KeyboardInterrupt:
        print("stopped: summarising the runs that finished", flush=True)
    summary = summarise(pairs)
    save_json(args.out / f"{args.prefix}s.json", summary)
    save_plot(lambda path: plot(summary, path), args.out / f"{args.prefix}s.png")
    print("\n| pair | full mean (p90) s | sync mean (p90) s | sync/full | load before full, sync |")
    print("| --- | --- | --- | --- | --- |")
    for p in summary["pairs"]:
        if "ratio_sync_over_full" not in p:
            continue
        f, s = p["full"], p["sync"]
        means = f"{f['mean_s']:.1f} ({f['p90_s']:.1f}) | {s['mean_s']:.1f} ({s['p90_s']:.1f})"
        loads = f"{f['load_before']}, {s['load_before']}"
        print(f"| {p['pair']} | {means} | {p['ratio_sync_over_full']:.2f}× | {loads} |")
    median = summary["median_ratio_sync_over_full"]
    if median is not None:
        print(f"\nmedian sync/full: {median:.2f}×; full faster in {summary['full_faster_in']} of "
              f"{summary['complete_pairs']} pairs")  # fmt: skip
    if "median_ratio_variant_over_full" in summary:
        label = summary["variant"]
        print(f"\n| pair | full mean (p90) s | full ({label}) mean (p90) s | {label}/full |")
        print("| --- | --- | --- | --- |")
        for p in summary["pairs"]:
            if "ratio_variant_over_full" in p:
                f, v = p["full"], p["variant"]
                print(f"| {p['pair']} | {f['mean_s']:.1f} ({f['p90_s']:.1f}) | {v['mean_s']:.1f} "
                      f"({v['p90_s']:.1f}) | {p['ratio_variant_over_full']:.2f}× |")  # fmt: skip
        median = summary["median_ratio_variant_over_full"]
        faster = summary["full_faster_than_variant_in"]
        print(f"\nmedian {label}/full: {median:.2f}×; the default config faster in {faster} of "
              f"{sum('ratio_variant_over_full' in p for p in summary['pairs'])} pairs")  # fmt: skip
    for p in summary["pairs"]:
        for policy in POLICIES:
            if policy in p and "waited" in p[policy]:
                print(f"pair {p['pair']} {policy}: {p[policy]['waited']}")
    for p in summary["pairs"]:
        for policy in POLICIES:
            if policy in p and "discarded" in p[policy]:
                print("\n".join(describe_run(f"pair {p['pair']} {policy}", p[policy])))


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
