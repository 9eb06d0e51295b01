"""A study's outputs: results.csv, report.md and PNG plots, from its points' rows.

Points through a pipeline (pp > 1) also get the measured bubble, rank 0's (stage 0's) wait
on the other stages over its stage compute, set against the textbook (p − 1)/m (GPipe,
1F1B) or (p − 1)/(v·m) (interleaved) in a table and ``bubble.png``.

Speedup is measured against the baseline point, the successful point with the fewest
ranks (the 1-rank point when the grid has one), with n = world_size / baseline world size:

- strong scaling (same global batch): speedup = t_base / t_n (median step times);
- weak scaling (batch grows with dp): speedup = (tokens_n / tokens_base) · t_base / t_n;
- efficiency = speedup / n.
"""

from __future__ import annotations

import csv
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from studies.perfmodel.pipeline import bubble_fraction

# The per-step time breakdown, in seconds: a column each, and the breakdown table's cells.
TIME_PARTS = (
    "compute_s",
    "tp_comm_s",
    "dp_comm_exposed_s",
    "dp_comm_total_s",
    "data_s",
    "optimizer_s",
)
COLUMNS = (
    "nodes",
    "procs_per_node",
    "tp_size",
    "dp_size",
    "pp_size",
    "cp_size",
    "world_size",
    "micro_batch",
    "global_batch",
    "schedule",
    "virtual_stages",
    "microbatches",
    "step_time_s",
    "step_time_p10_s",
    "step_time_p90_s",
    "tokens_per_s",
    "tflops_per_rank",
    "speedup",
    "efficiency",
    *TIME_PARTS,
    "pp_compute_s",
    "pp_wait_s",
    "pp_bubble",
    "bubble_formula",
    "peak_mem_gib",
    # run-level figures of workloads that train to a target (classify); empty otherwise
    "time_to_accuracy_s",
    "test_accuracy",
    "images_per_s",
    "tta_speedup",
    "tta_efficiency",
)
SHORT = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interl."}  # bar labels
SHARES = (
    ("compute_s", "compute"),
    ("tp_comm_s", "TP comm"),
    ("dp_comm_exposed_s", "DP comm exposed"),
    ("data_s", "data"),
    ("optimizer_s", "optimizer"),
)


def add_speedup(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The successful rows with speedup and efficiency against the baseline point (and
    the pipelined ones their ``bubble_formula``)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    base = min(ok, key=lambda r: (r["world_size"], r["nodes"]))
    for r in ok:
        n = r["world_size"] / base["world_size"]
        speedup = base["step_time_s"] / r["step_time_s"]
        if mode == "weak":
            speedup *= r["global_batch"] / base["global_batch"]
        r["speedup"], r["efficiency"] = speedup, speedup / n
        t_base, t_n = base.get("time_to_accuracy_s"), r.get("time_to_accuracy_s")
        if t_base is not None and t_n is not None:
            r["tta_speedup"] = t_base / t_n
            r["tta_efficiency"] = r["tta_speedup"] / n
    pipelined(ok)
    return ok


def layout(row: dict[str, Any]) -> str:
    """The point's model-parallel layout (``tp=1``, ``tp=1 pp=2 1f1b``); rows of studies
    made before the pipeline axis have only a tp size."""
    return row.get("layout") or f"tp={row['tp_size']}"


def pipelined(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows through a pipeline, each given ``bubble_formula``: (p − 1)/m, or
    (p − 1)/(v·m) interleaved (``studies.perfmodel.pipeline``, the planner's term)."""
    out = [r for r in rows if r.get("pp_size", 1) > 1]
    for r in out:
        m, v = r["microbatches"], r.get("virtual_stages", 1)
        r["bubble_formula"] = bubble_fraction(r["pp_size"], m, r["schedule"], v)
    return out


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    os.replace(tmp, path)


def plot(rows: list[dict[str, Any]], out: Path, title: str = "") -> list[Path]:
    """speedup.png, efficiency.png and time_shares.png; returns their paths. ``title`` (the
    workload and mode) follows each figure's own title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["nodes"], layout(r)), []).append(r)
    base = min(r["world_size"] for r in rows)
    heads = {"speedup": f"Speedup over {base} rank(s)", "efficiency": "Parallel efficiency"}
    paths = []
    for key, ideal in (("speedup", True), ("efficiency", False)):
        fig, ax = plt.subplots(figsize=(8.5, 4), dpi=100)  # the legend beside the lines
        worlds = sorted({r["world_size"] for r in rows})
        # Each series its own marker and dash, drawn thinner as it comes later, so that
        # two that coincide (1 and 2 nodes at one rank) both stay visible.
        for i, ((nodes, lay), group) in enumerate(sorted(series.items())):
            group = sorted(group, key=lambda r: r["world_size"])
            ax.plot(
                [r["world_size"] for r in group],
                [r[key] for r in group],
                marker="osD^v<>"[i % 7],
                linestyle=("-", "--", "-.", ":")[i % 4],
                markersize=9 - 1.5 * (i % 4),
                lw=2.5 - 0.5 * (i % 4),
                label=f"{nodes} node{'s' if nodes > 1 else ''}, {lay}",
            )
        ideal_y = [w / base for w in worlds] if ideal else [1.0] * len(worlds)
        ax.plot(worlds, ideal_y, color="0.5", linestyle=(0, (1, 3)), lw=1.5, label="ideal")
        ax.set_xlabel("ranks (processes)", fontsize=11)
        ax.set_ylabel(key, fontsize=11)
        ax.set_title(heads[key] + (f"\n{title}" if title else ""), fontsize=11)
        ax.set_xticks(worlds)
        ax.tick_params(labelsize=10)
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / f"{key}.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    paths.append(_plot_shares(rows, out / "time_shares.png", plt, title))
    if pipelined(rows):
        paths.append(_plot_bubble(pipelined(rows), out / "bubble.png", plt, title))
    return paths


def _plot_bubble(rows: list[dict[str, Any]], path: Path, plt, title: str) -> Path:
    """Measured bubble (wait ÷ stage compute) against the formula, one marker per point;
    the dotted diagonal is where they would agree."""
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    # One legend entry per point (its layout, dp and m) instead of labels beside the
    # markers, which collide where two points measure alike.
    for i, r in enumerate(rows):
        y = r["pp_bubble"] if r.get("pp_bubble") is not None else float("nan")
        nodes = f"{r['nodes']} node{'s' if r['nodes'] > 1 else ''}"
        ax.scatter(
            [r["bubble_formula"]],
            [y],
            marker="osD^v<>P"[i % 8],
            s=70 - 10 * (i % 4),
            zorder=3,
            label=f"{nodes}, {layout(r)}, dp={r['dp_size']}, m={r['microbatches']}",
        )
    top = max([r["bubble_formula"] for r in rows] + [r.get("pp_bubble") or 0 for r in rows])
    ax.plot(
        [0, top * 1.1],
        [0, top * 1.1],
        color="0.5",
        linestyle=(0, (1, 3)),
        lw=1.5,
        label="measured = formula",
    )
    ax.set_xlabel("formula: (p − 1)/m, interleaved (p − 1)/(v·m)", fontsize=11)
    ax.set_ylabel("measured: stage 0 wait ÷ its compute", fontsize=11)
    ax.set_title(
        "Pipeline bubble, measured against the formula" + (f"\n{title}" if title else ""),
        fontsize=11,
    )
    ax.tick_params(labelsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _step_parts(row: dict[str, Any]) -> dict[str, float]:
    """Seconds of each part of a mean step; a pipelined step's compute split into the
    stages' own work and their wait on each other (the bubble and the hand-offs)."""
    parts = {name: row.get(key) or 0.0 for key, name in SHARES}
    wait = row.get("pp_wait_s") or 0.0
    parts["compute"] = max(0.0, parts["compute"] - wait)
    return {"compute": parts.pop("compute"), "pipeline wait": wait, **parts}


def _plot_shares(rows: list[dict[str, Any]], path: Path, plt, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 3), 4.2), dpi=100)
    # Every label distinct: bars with one label would be drawn on top of each other.
    labels = [
        f"{r['nodes']} node{'s' if r['nodes'] > 1 else ''}\ntp={r['tp_size']} dp={r['dp_size']}"
        + (f" cp={r['cp_size']}" if r.get("cp_size", 1) > 1 else "")
        + (f"\npp={r['pp_size']} {SHORT[r['schedule']]}" if r.get("pp_size", 1) > 1 else "")
        + (f" v{r['virtual_stages']}" if r.get("virtual_stages", 1) > 1 else "")
        for r in rows
    ]
    bottom = [0.0] * len(rows)
    parts = [_step_parts(r) for r in rows]
    for name in parts[0]:
        if name == "pipeline wait" and not pipelined(rows):
            continue  # no bar part, no legend entry, for what no point has
        shares = [part[name] / (sum(part.values()) or 1.0) for part in parts]
        ax.bar(labels, shares, bottom=bottom, label=name)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    ax.set_ylabel("share of step time", fontsize=11)
    ax.set_title("Where the step time goes" + (f"\n{title}" if title else ""), fontsize=11)
    ax.tick_params(axis="x", labelsize=10)
    ax.tick_params(axis="y", labelsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def machine() -> str:
    """One line about this host."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {gpu}, Linux "
        f"{platform.release()}, torch {torch.__version__}"
    )


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def speedup_table(rows: list[dict[str, Any]]) -> list[str]:
    """Ranks down, nodes across: 'speedup (efficiency)', one table per layout (tp size,
    and pipeline)."""
    lines = []
    for lay in sorted({layout(r) for r in rows}):
        sub = [r for r in rows if layout(r) == lay]
        nodes = sorted({r["nodes"] for r in sub})
        lines += [
            f"{lay}: speedup (efficiency) against the baseline point",
            "",
            "| ranks | " + " | ".join(f"{n} node(s)" for n in nodes) + " |",
            "|---:|" + "---:|" * len(nodes),
        ]
        for world in sorted({r["world_size"] for r in sub}):
            cells = []
            for n in nodes:
                hit = [r for r in sub if r["world_size"] == world and r["nodes"] == n]
                cells.append(
                    f"{hit[0]['speedup']:.2f} ({100 * hit[0]['efficiency']:.0f}%)" if hit else "–"
                )
            lines.append(f"| {world} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def accuracy_table(rows: list[dict[str, Any]]) -> list[str]:
    """Ranks × nodes → time to the target accuracy and its speedup, for workloads with one."""
    # Only workloads with a target accuracy have one (a pre-training study's rows carry the
    # column empty): no table of n/a cells for them.
    timed = [r for r in rows if r.get("test_accuracy") is not None]
    if not timed:
        return []
    lines = [
        "Speedup = time to accuracy of the baseline point ÷ that of the row; efficiency ="
        " speedup ÷ (ranks ÷ baseline ranks).",
        "",
        "| ranks × nodes | tp | global batch | epochs | test accuracy | time to accuracy | "
        "images/s | speedup | efficiency |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(timed, key=lambda r: (r["tp_size"], r["nodes"], r["world_size"])):
        tta = r.get("time_to_accuracy_s")
        lines.append(
            f"| {r['procs_per_node']} × {r['nodes']} | {r['tp_size']} | {r['global_batch']} | "
            f"{_fmt(r.get('epochs'), digits=0)} | {_fmt(r.get('test_accuracy'), digits=4)} | "
            + ("not reached" if tta is None else f"{tta:.2f} s")
            + f" | {_fmt(r.get('images_per_s'), digits=0)} | {_fmt(r.get('tta_speedup'), digits=2)}"
            f" | {_fmt(r.get('tta_efficiency'), 100, 0)}% |"
        )
    return lines + [""]


def _point(row: dict[str, Any]) -> str:
    """``nodes×procs tpT dpD`` (and ``ppP schedule``): a row's name in the tables."""
    name = f"{row['nodes']}×{row['procs_per_node']} tp{row['tp_size']} dp{row['dp_size']}"
    name += f" cp{row['cp_size']}" if row.get("cp_size", 1) > 1 else ""
    if row.get("pp_size", 1) > 1:
        virtual = f" v{row['virtual_stages']}" if row.get("virtual_stages", 1) > 1 else ""
        name += f" pp{row['pp_size']} {row['schedule']}{virtual}"
    return name


def pipeline_table(rows: list[dict[str, Any]]) -> list[str]:
    """The pipelined points' stage compute, wait and measured bubble against the formula."""
    lines = [
        "Rank 0 (stage 0) times its stages' forward, backward and loss of every micro-batch"
        " (stage compute); the rest of the schedule's wall time is its wait on the other"
        " stages (the bubble and the hand-offs). Measured bubble = wait ÷ stage compute;"
        " formula = (p − 1)/m, interleaved (p − 1)/(v·m), for equal stages.",
        "",
        "| point | p | v | m | stage compute ms | wait ms | measured bubble | formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in pipelined(rows):
        lines.append(
            f"| {_point(r)} | {r['pp_size']} | {r.get('virtual_stages', 1)} | "
            f"{r['microbatches']} | {_fmt(r.get('pp_compute_s'), 1e3)} | "
            f"{_fmt(r.get('pp_wait_s'), 1e3)} | {_fmt(r.get('pp_bubble'), digits=3)} | "
            f"{r['bubble_formula']:.3f} |"
        )
    return lines + [""]


def breakdown_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| point | step ms (p10–p90) | compute | TP comm | DP exposed | DP total | data | "
        "optimizer | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = [_fmt(r.get(k), 1e3) for k in TIME_PARTS]
        lines.append(
            f"| {_point(r)} | "
            f"{_fmt(r['step_time_s'], 1e3)} ({_fmt(r['step_time_p10_s'], 1e3)}–"
            f"{_fmt(r['step_time_p90_s'], 1e3)}) | "
            + " | ".join(ms)
            + f" | {_fmt(r.get('tokens_per_s'), digits=0)} |"
        )
    return lines


def link_table(links: dict[str, Any]) -> list[str]:
    rate = links.get("configured_mbit")
    shaped = (
        f"{rate} Mbit/s (tc tbf, each direction). Latency is not injected."
        if rate
        else "none (no --cluster, so no link is shaped)."
    )
    lines = [
        f"Configured inter-node link: {shaped}",
        "",
        "| link | message | all-reduce time | bus bandwidth |",
        "|---|---:|---:|---:|",
    ]
    for name in ("intra_node", "inter_node"):
        for row in links.get(name, []):
            lines.append(
                f"| {name} | {row['bytes']} B | {row['time_s'] * 1e6:.0f} µs | "
                f"{row['busbw_Gbps'] * 1e3:.1f} Mbit/s |"
            )
    return lines


def write_report(
    rows: list[dict[str, Any]],
    failed: list[dict[str, Any]],
    *,
    out: Path,
    links: dict[str, Any],
    command: str,
    load: str,
    mode: str,
) -> Path:
    """report.md next to results.csv and the plots."""
    lines = [
        "# Scaling study",
        "",
        f"- command: `{command}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {machine()}",
        f"- load average (1/5/15 min): {load}",
        f"- mode: {mode} scaling",
        "",
        "## Speedup",
        "",
    ]
    lines += speedup_table(rows) if rows else ["no successful points", ""]
    accuracy = accuracy_table(rows)
    if accuracy:
        lines += ["## Time to accuracy", ""] + accuracy
    lines += ["## Where the time goes (mean ms per step)", ""] + breakdown_table(rows)
    bubble = pipelined(rows)
    if bubble:
        lines += ["", "## Pipeline bubble", ""] + pipeline_table(rows)
    if links.get("intra_node") or links.get("inter_node"):  # none with --no-links
        lines += ["", "## Links", ""] + link_table(links)
    images = (
        "![speedup](speedup.png) ![efficiency](efficiency.png)\n![time shares](time_shares.png)"
    )
    lines += ["", images + (" ![bubble](bubble.png)" if bubble else ""), ""]
    if failed:
        lines += ["## Failed points", ""] + [f"- {r['key']}: {r['error']}" for r in failed]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
