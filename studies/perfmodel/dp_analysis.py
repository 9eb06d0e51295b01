"""Parameter server vs ring all-reduce, and synchronous vs asynchronous data parallelism.

Model outputs (not measurements) for docs/PERFMODEL.md; every assumption is a parameter:

- gradient exchange per step: ring / tree all-reduce (studies.perfmodel.comm_cost) against a
  parameter server whose ``servers`` links carry 2·p·n/servers bytes each;
- stragglers: each worker's compute time is T·(1 + X), X exponential with mean σ. A
  synchronous step waits for the slowest: E[max] = T·(1 + σ·H_p) (H_p the harmonic
  number). An asynchronous worker never waits: T·(1 + σ) per update, but the servers'
  bandwidth caps the update rate, and each gradient is τ ≈ p − 1 updates stale;
- convergence: updates needed to reach a target grow as (1 + c·τ) with staleness τ;
  ``c`` is an assumption (plotted for several values), not a measured constant.
"""

from __future__ import annotations

from studies.perfmodel.comm_cost import (
    Link,
    async_staleness,
    parameter_server_time,
    ring_all_reduce,
    tree_all_reduce,
)


def harmonic(p: int) -> float:
    """H_p = 1 + 1/2 + … + 1/p."""
    return sum(1.0 / k for k in range(1, p + 1))


def exchange_seconds(n_bytes: float, p: int, link: Link, servers: int | None = None) -> dict:
    """Seconds per step to exchange ``n_bytes`` of gradients among ``p`` workers."""
    out = {"ring": ring_all_reduce(n_bytes, p, link), "tree": tree_all_reduce(n_bytes, p, link)}
    for k in (1, 8) if servers is None else (servers,):
        out[f"ps{k}"] = parameter_server_time(n_bytes, p, k, link)
    out["ps_sharded_p"] = parameter_server_time(n_bytes, p, p, link)
    return out


def sync_update_rate(p: int, compute_s: float, sigma: float, allreduce_s: float) -> float:
    """Updates per second of synchronous DP (each update averages p gradients)."""
    return 1.0 / (compute_s * (1 + sigma * harmonic(p)) + allreduce_s)


def async_update_rate(
    p: int, compute_s: float, sigma: float, n_bytes: float, servers: int, link: Link
) -> float:
    """Updates per second of asynchronous DP (each update applies one worker's gradient)."""
    per_worker = 1.0 / (compute_s * (1 + sigma) + 2 * n_bytes / link.bandwidth_Bps)
    server_cap = servers * link.bandwidth_Bps / (2 * n_bytes)
    return min(p * per_worker, server_cap)


def time_to_target(
    p: int,
    compute_s: float,
    sigma: float,
    n_bytes: float,
    link: Link,
    *,
    servers: int,
    c: float,
    sync_updates: float = 1e4,
) -> tuple[float, float]:
    """(sync, async) seconds to the target loss.

    Synchronous DP needs ``sync_updates`` updates of a p× larger batch; asynchronous DP
    needs p× as many single-worker updates (the same samples), times (1 + c·τ) for staleness.
    """
    sync = sync_updates / sync_update_rate(p, compute_s, sigma, ring_all_reduce(n_bytes, p, link))
    updates = sync_updates * p * (1 + c * async_staleness(p))
    return sync, updates / async_update_rate(p, compute_s, sigma, n_bytes, servers, link)


def _overlaps(a: list[float], b: list[float], rel: float = 0.02) -> bool:
    """Whether two series would be drawn on top of each other (within 2 % on a log axis)."""
    return all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def _save(plt, fig, ax, path: str, ylabel: str, title: str) -> str:
    """Log-log axes over workers p, the legend, and the PNG at ``path``."""
    ax.set(xscale="log", yscale="log", xlabel="workers p", ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_exchange(plt, ps: list[int], n_bytes: float, link: Link, path: str) -> str:
    """Seconds per gradient exchange: all-reduce against parameter servers."""
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [exchange_seconds(n_bytes, p, link) for p in ps]
    drawn: dict[str, list[float]] = {}
    for key, label in (
        ("ring", "ring all-reduce"),
        ("tree", "tree all-reduce"),
        ("ps1", "1 parameter server"),
        ("ps8", "8 parameter servers"),
        ("ps_sharded_p", "p sharded servers"),
    ):
        ys = [r[key] for r in rows]
        same = next((name for name, other in drawn.items() if _overlaps(ys, other)), None)
        # A series that would hide under one already drawn (p sharded servers move 2n/bw per
        # worker, as the tree does, to within latency terms) is drawn dashed with hollow
        # markers on top, and says so.
        style = dict(linestyle="--", marker="o", markersize=9, markerfacecolor="none", lw=2)
        ax.plot(
            ps,
            ys,
            label=f"{label} (≈ {same})" if same else label,
            **(style if same else dict(marker="o", markersize=5)),
        )
        drawn[label] = ys
    title = "Gradient exchange, 2.6 GB (1.3B bf16), 25 GB/s links"
    return _save(plt, fig, ax, path, "seconds per step", title)


def _plot_sync_vs_async(
    plt, ps: list[int], n_bytes: float, compute_s: float, link: Link, path: str
) -> str:
    """Hours to the target loss: asynchronous DP at several staleness costs against sync."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in (0.0, 0.05, 0.2):
        ax.plot(
            ps,
            [
                time_to_target(p, compute_s, 0.1, n_bytes, link, servers=8, c=c)[1] / 3600
                for p in ps
            ],
            marker="s",
            label=f"async, 8 servers, c={c}",
        )
    ax.plot(
        ps,
        [time_to_target(p, compute_s, 0.1, n_bytes, link, servers=8, c=0)[0] / 3600 for p in ps],
        marker="o",
        color="k",
        label="sync ring all-reduce",
    )
    title = "Sync vs async DP (σ=0.1 stragglers, 0.5 s compute)"
    return _save(plt, fig, ax, path, "hours to target (model)", title)


def write_plots(out_dir: str, n_bytes: float = 1.3e9 * 2, compute_s: float = 0.5) -> list[str]:
    """The two PNGs of docs/PERFMODEL.md (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    link = Link(25e9, 5e-6)  # one 200 Gb/s adapter per worker and per server
    ps = [2, 4, 8, 16, 32, 64, 128, 256]
    return [
        _plot_exchange(plt, ps, n_bytes, link, f"{out_dir}/perfmodel_ps_vs_ring.png"),
        _plot_sync_vs_async(
            plt, ps, n_bytes, compute_s, link, f"{out_dir}/perfmodel_sync_vs_async.png"
        ),
    ]
