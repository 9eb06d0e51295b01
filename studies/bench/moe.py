"""MoE layer speed: meshtron's ``MoEMLP`` against transformers' ``MixtralSparseMoeBlock`` on
the same weights and tokens, and the expert-parallel dispatch overhead at ep 2 against ep 1.

``layer`` (one process, fp32, forward + backward): transformers' block drawn once, its
weights copied into meshtron's layer (``studies.verification.moe_blocks``), both run on the
same tokens and output gradient; transformers' block twice, with its own per-expert loop
("eager") and with ``torch._grouped_mm`` ("grouped_mm"). Reported: the median time of each,
transformers ÷ meshtron, the max abs difference of each output from meshtron's (a
correctness check beside the timing) and which GEMM path meshtron took
(``layers.moe.grouped_mm_fits``: ``torch._grouped_mm`` or its per-expert loop).

``ep`` (two local gloo ranks, one thread each): the same layer on each rank's own tokens,
at ep 1 (every rank holds every expert; no all-to-all) and at ep 2 (half the experts each,
rows dispatched and combined by all-to-all, ``layers.expert_parallel``). Equal work per
rank at both, so the difference is the dispatch: the plan, the regrouping and the
all-to-alls, whose wall time (waits on the other rank included) is reported too.

Every variant takes turns with the others step by step after untimed warm-up steps, so a
change in the machine's load moves them alike; the median of the timed steps is reported.

    python tools/bench_moe.py                                  # both parts
    python tools/bench_moe.py --only ep --tokens 512 --json moe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from engine.tool_args import ArgumentParser, non_negative_int, output_file, positive_int

F32 = torch.float32
PARTS = ("layer", "ep")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(prog="bench_moe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=PARTS, help="run one part (default: both)")
    p.add_argument("--experts", type=positive_int, default=8)
    p.add_argument("--top-k", type=positive_int, default=2)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--ffn", type=positive_int, default=512, help="each expert's ffn width")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens (per rank)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (layer)")
    p.add_argument(
        "--json", type=output_file, metavar="PATH", help="also write the results as JSON"
    )
    args = p.parse_args(argv)
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}; choose k ≤ experts")
    if args.hidden % 2:
        p.error(f"--hidden {args.hidden} is odd; choose an even width (2 heads)")
    return args


def layer_config(args: argparse.Namespace):
    """The meshtron config of the timed layer: ``moe_tiny``'s Mixtral-style layer (SwiGLU
    experts without biases, softmax top-k renormalised, dropless) at the flags' sizes."""
    from engine.models.config import preset

    cfg = preset(
        "moe_tiny",
        hidden_size=args.hidden,
        num_heads=2,
        num_kv_heads=2,
        kernels="torch",
        moe_num_experts=args.experts,
        moe_top_k=args.top_k,
        moe_ffn_hidden_size=args.ffn,
        moe_renormalize=True,
    )
    cfg.validate()
    return cfg


def step(layer: Callable, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One forward + backward of ``layer`` on ``x`` with output gradient ``grad``."""
    x = x.detach().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out.detach()


def take_turns(
    runs: dict[str, Callable[[], object]],
    warmup: int,
    repeats: int,
    before: Callable[[], object] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` calls of every run, the runs taking turns (A, B, A, B…)
    after ``warmup`` untimed rounds; ``before()`` runs untimed ahead of every call."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + repeats):
        for name, run in runs.items():
            before()
            start = time.perf_counter()
            run()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def median_ms(seconds: list[float]) -> float:
    """The median of ``seconds`` in milliseconds."""
    return statistics.median(seconds) * 1e3


def hf_blocks(args: argparse.Namespace, gen: torch.Generator) -> dict[str, torch.nn.Module]:
    """transformers' Mixtral block with weights drawn from ``gen`` (std 1/√fan-in, so the
    outputs are O(1)), once per experts implementation, the same weights in each."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    blocks = {}
    for impl in ("eager", "grouped_mm"):
        config = MixtralConfig(
            hidden_size=args.hidden,
            intermediate_size=args.ffn,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
        config._experts_implementation = impl
        blocks[impl] = MixtralSparseMoeBlock(config).to(F32)
    with torch.no_grad():
        for p in blocks["eager"].parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        blocks["grouped_mm"].load_state_dict(blocks["eager"].state_dict())
    return blocks


def meshtron_path(moe) -> str:
    """Which GEMM ``moe``'s experts take in fp32 (``layers.moe.grouped_mm``'s "auto")."""
    from layers.moe import grouped_mm_fits

    fc1, fc2 = moe.experts.fc1, moe.experts.fc2
    rows = (fc1.new_empty(1, fc1.shape[1]), fc2.new_empty(1, fc2.shape[1]))
    fits = all(grouped_mm_fits(x, w) for x, w in zip(rows, (fc1, fc2), strict=True))
    if moe.experts.impl == "loop" or not (fits or moe.experts.impl == "grouped"):
        return "per-expert loop"
    return "torch._grouped_mm"


def bench_layer(args: argparse.Namespace) -> dict:
    """Part ``layer`` (module docstring): the rows of its table."""
    from layers.moe import MoEMLP
    from studies.verification.moe_blocks import copy_block_weights

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    blocks = hf_blocks(args, gen)
    moe = MoEMLP(layer_config(args), tp_group=None, dtype=F32, device="cpu")
    copy_block_weights(moe, blocks["eager"])
    x = torch.randn(args.tokens, 1, args.hidden, generator=gen)  # ours [s, b, h], b = 1
    grad = torch.randn(x.shape, generator=gen)
    layers = {"meshtron": lambda t: moe(t)[0]}
    for impl, block in blocks.items():  # transformers' [b, s, h]
        layers[f"transformers {impl}"] = lambda t, b=block: b(t.transpose(0, 1)).transpose(0, 1)
    outs = {name: step(layer, x, grad) for name, layer in layers.items()}
    runs = {name: (lambda f=layer: step(f, x, grad)) for name, layer in layers.items()}
    times = take_turns(runs, args.warmup, args.repeats)
    base = median_ms(times["meshtron"])
    return {
        "meshtron_path": meshtron_path(moe),
        "out_max_abs": outs["meshtron"].abs().max().item(),
        "rows": [
            {
                "layer": name,
                "ms": median_ms(times[name]),
                "ratio": median_ms(times[name]) / base,
                "max_abs_diff": (outs[name] - outs["meshtron"]).abs().max().item(),
            }
            for name in layers
        ],
    }


@contextlib.contextmanager
def timed_exchanges(spent: list[float]) -> Iterator[None]:
    """Append the wall seconds of every ep exchange (``layers.expert_parallel._exchange``:
    the counts' and the rows' all-to-alls, forward and backward) to ``spent``. The
    all-to-alls take no comm timer, so this wraps the one function they all call, and
    puts it back on exit."""
    import layers.expert_parallel as ep

    original = ep._exchange

    def exchange(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    ep._exchange = exchange
    try:
        yield
    finally:
        ep._exchange = original


def _ep_rank(args: argparse.Namespace) -> dict | None:
    """One rank of part ``ep``; rank 0 returns the times, the others None."""
    import torch.distributed as dist

    from engine.bootstrap import bootstrap_rank
    from engine.config import Config, parallel_dims
    from layers.moe import MoEMLP, shard_experts

    cfg = layer_config(args)
    dims = parallel_dims(Config(model=cfg, tp_size=1, dp_size=2, ep_size=2), 2)
    with bootstrap_rank(dims, backend="gloo", split_cores=False) as ps:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        whole = MoEMLP(cfg, tp_group=ps.tp_group, dtype=F32, device="cpu")
        split = MoEMLP(cfg, tp_group=ps.tp_group, dtype=F32, device="cpu")
        split.load_state_dict(whole.state_dict())
        shard_experts(split, ps.group("expert"))
        gen = torch.Generator().manual_seed(1 + ps.rank)  # each rank its own tokens
        x = torch.randn(args.tokens, 1, args.hidden, generator=gen)
        grad = torch.randn(x.shape, generator=gen)
        layers = {"ep 1": lambda t: whole(t)[0], "ep 2": lambda t: split(t)[0]}
        diff = (step(layers["ep 2"], x, grad) - step(layers["ep 1"], x, grad)).abs().max()
        spent: list[float] = []
        marks: list[int] = []  # len(spent) at the start of each ep 2 step

        def run_split():
            marks.append(len(spent))
            step(layers["ep 2"], x, grad)

        runs = {"ep 1": lambda: step(layers["ep 1"], x, grad), "ep 2": run_split}
        with timed_exchanges(spent):
            times = take_turns(runs, args.warmup, args.repeats, before=dist.barrier)
        ends = [*marks[1:], len(spent)]
        a2a = [sum(spent[a:b]) for a, b in zip(marks, ends, strict=True)][args.warmup :]
        if ps.rank:
            return None
        return {"times": times, "a2a": a2a, "max_abs_diff": diff.item()}


def bench_ep(args: argparse.Namespace) -> dict:
    """Part ``ep`` (module docstring) on two local ranks: the rows of its table."""
    from studies.verification.layouts import launch_local

    got = launch_local(_ep_rank, 2, args)
    base = median_ms(got["times"]["ep 1"])
    rows = [
        {"layout": "ep 1", "ms": base, "ratio": 1.0, "a2a_ms": 0.0},
        {
            "layout": "ep 2",
            "ms": median_ms(got["times"]["ep 2"]),
            "ratio": median_ms(got["times"]["ep 2"]) / base,
            "a2a_ms": median_ms(got["a2a"]),
        },
    ]
    return {"max_abs_diff": got["max_abs_diff"], "rows": rows}


def layer_table(result: dict) -> list[str]:
    """Part ``layer``'s markdown table."""
    lines = [
        "| layer | fwd+bwd ms | ÷ meshtron | max abs diff from meshtron |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        name = row["layer"]
        if name == "meshtron":
            name = f"meshtron MoEMLP ({result['meshtron_path']})"
        lines.append(
            f"| {name} | {row['ms']:.1f} | {row['ratio']:.2f} | {row['max_abs_diff']:.1e} |"
        )
    return lines


def ep_table(result: dict) -> list[str]:
    """Part ``ep``'s markdown table."""
    lines = ["| layout | step ms | ÷ ep 1 | all-to-all ms |", "|---|---:|---:|---:|"]
    for row in result["rows"]:
        a2a = f"{row['a2a_ms']:.1f}" if row["layout"] != "ep 1" else "-"
        lines.append(f"| {row['layout']} | {row['ms']:.1f} | {row['ratio']:.2f} | {a2a} |")
    return lines


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages (Linux), or "n/a"."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts, print their tables, write the JSON."""
    args = parse_args(argv)
    parts = [args.only] if args.only else list(PARTS)
    sizes = f"E={args.experts} top-{args.top_k} h={args.hidden} ffn={args.ffn}"
    results: dict = {"args": vars(args), "loadavg_before": loadavg()}
    if "layer" in parts:
        results["layer"] = bench_layer(args)
        print(f"\nlayer: {sizes}, {args.tokens} tokens, fp32, {args.threads} thread(s), ", end="")
        print(f"median of {args.repeats} interleaved fwd+bwd steps\n")
        print("\n".join(layer_table(results["layer"])), flush=True)
    if "ep" in parts:
        results["ep"] = bench_ep(args)
        print(
            f"\nep: {sizes}, {args.tokens} tokens per rank, 2 gloo ranks, 1 thread each, ", end=""
        )
        print(f"median of {args.repeats}; ep 2 vs ep 1 outputs max abs diff ", end="")
        print(f"{results['ep']['max_abs_diff']:.1e}\n")
        print("\n".join(ep_table(results["ep"])))
    results["loadavg_after"] = loadavg()
    print(f"\nload average (1/5/15 min): {results['loadavg_before']} before, ", end="")
    print(f"{results['loadavg_after']} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
