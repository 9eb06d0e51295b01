"""How evenly ring attention's load-balanced layout spreads causal work over the cp ranks.

Runs ``layers.ring_attention`` forward and backward at cp N on N local ranks (gloo, CPU,
one thread each) and times, per rank, only its attention compute: the per-block kernels
and the log-sum-exp merges, with ``time.thread_time()`` (this thread's CPU time), so the
waits on the ring barely count. The figure is the ratio busiest ÷ least busy rank (1.0:
perfectly even). Beside it, the same ranks compute the blocks a contiguous split would
give them (rank r: its causal diagonal and r whole blocks of the ranks before it), no ring
needed, for contrast.

Ranks that run at once share the machine's cores and caches, so each one's CPU time also
counts its neighbours' memory traffic (on 2 cores, 4 ranks measured 1.06 and 1.13 a minute
apart, another rank the busiest each time). So each rank also records the kernel calls of
its last ring pass (their inputs copied, to a temporary file), and once the ranks have
exited this process replays every rank's calls on one thread, the ranks in turn, round
after round: the "alone" column, each rank's own work with nothing beside it, the least
of ``--replays`` rounds (noise only adds time; the rounds interleave the ranks, so a
drift of the machine's speed meets them all alike).

    python tools/bench_cp_balance.py --cp 4 --seq 4096 --heads 4 --head-dim 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.tool_args import ArgumentParser, positive_int

    p = ArgumentParser(prog="bench_cp_balance.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=positive_int, default=4, help="context-parallel ranks (processes)")
    p.add_argument("--seq", type=positive_int, default=4096, help="tokens (divisible by 2·cp)")
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed forward+backward passes")
    p.add_argument("--replays", type=positive_int, default=25, help="rounds of the replay alone")
    p.add_argument("--no-contiguous", action="store_true", help="skip the contiguous contrast")
    return p.parse_args(argv)


class _Clock:
    """CPU seconds this thread spent in the wrapped functions of ``layers.ring_attention``."""

    NAMES = ("_block_forward", "_block_backward", "_merge_")

    def __init__(self) -> None:
        import layers.ring_attention as ring

        self.ring, self.seconds = ring, 0.0
        self.calls: list | None = None  # a list: each call (its name, copied inputs) kept
        self.originals = {name: getattr(ring, name) for name in self.NAMES}
        for name, fn in self.originals.items():
            vars(self.ring)[name] = self._timed(fn)  # the module's own name, wrapped

    def _timed(self, fn):
        def timed(*args):
            if self.calls is not None:
                self.calls.append((fn.__name__, [_copy(a) for a in args]))
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                self.seconds += time.thread_time() - start

        return timed

    def remove(self) -> None:
        for name, fn in self.originals.items():
            vars(self.ring)[name] = fn


def _replay(calls: list) -> float:
    """CPU seconds of recorded ``(name, inputs)`` calls of ``layers.ring_attention`` run
    again in order, on fresh copies of their inputs (new memory each round, so no rank
    keeps a lucky or unlucky placement; the copying is not timed)."""
    import layers.ring_attention as ring

    fresh = [(getattr(ring, name), [_copy(a) for a in args]) for name, args in calls]
    start = time.thread_time()
    for fn, args in fresh:
        fn(*args)
    return time.thread_time() - start


def _alone(paths: list[str], rounds: int) -> list[float]:
    """Per rank, the least CPU time of ``rounds`` replays of its recorded calls, on this
    process's one thread, the ranks taking turns within each round."""
    torch.set_num_threads(1)
    calls = [torch.load(path, weights_only=True) for path in paths]
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for rank, recorded in enumerate(calls):
            best[rank] = min(best[rank], _replay(recorded))
    return best


def _copy(arg):
    return arg.detach().clone() if isinstance(arg, torch.Tensor) else arg


def _ring_pass(args, group, rank: int, g: torch.Generator) -> None:
    """One forward and backward of the ring over this rank's share."""
    from layers.ring_attention import ring_attention

    local = args.seq // args.cp
    q, k, v = (
        torch.randn(1, args.heads, local, args.head_dim, generator=g, requires_grad=True)
        for _ in range(3)
    )
    out = ring_attention(q, k, v, cp_group=group, causal=True)
    out.backward(torch.randn(out.shape, generator=g))


def _contiguous_pass(args, rank: int, g: torch.Generator, clock: _Clock) -> None:
    """The blocks rank ``rank`` of a contiguous split computes, forward and backward: its
    causal diagonal and one whole block per earlier rank (their K/V: random stand-ins)."""
    ring = clock.ring
    local, scale = args.seq // args.cp, args.head_dim**-0.5
    q = torch.randn(1, args.heads, 1, local, args.head_dim, generator=g)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    blocks = []
    for source in range(rank + 1):
        k, v = torch.randn(2, 1, args.heads, local, args.head_dim, generator=g)
        blocks.append((k, v, source == rank))
        o, m = ring._block_forward(q, k, v, scale, source == rank, None)
        ring._merge_(out, lse, o, m)
    dout, delta = torch.randn(q.shape, generator=g), torch.randn(q.shape[:-1], generator=g)
    for k, v, causal in blocks:
        ring._block_backward(q, k, v, dout, lse, delta, scale, causal, None)


def _rank(args) -> list[tuple[float, float]] | None:
    import torch.distributed as dist

    from engine.bootstrap import bootstrap_rank
    from engine.config import Config, parallel_dims

    dims = parallel_dims(Config(tp_size=1, dp_size=1, cp_size=args.cp), args.cp)
    with bootstrap_rank(dims, backend="gloo", max_threads=1) as ps:
        torch.set_num_threads(1)
        group, rank = ps.group("cp"), ps.rank_in("cp")
        g = torch.Generator().manual_seed(rank)
        clock, times = _Clock(), []
        try:
            _ring_pass(args, group, rank, g)  # warm-up: allocation, first messages
            for _ in range(args.repeats):
                clock.seconds = 0.0
                _ring_pass(args, group, rank, g)
                balanced = clock.seconds
                clock.seconds = 0.0
                if not args.no_contiguous:
                    _contiguous_pass(args, rank, g, clock)
                times.append((balanced, clock.seconds))
                dist.barrier(group)
            clock.calls = []  # one more ring pass, its kernel calls kept for the replays
            _ring_pass(args, group, rank, g)
            path = f"{args.record_dir}/rank{rank}.pt"
            torch.save(clock.calls, path)
        finally:
            clock.remove()
        every = [None] * args.cp
        dist.all_gather_object(every, (times, path), group=group)
        return every if ps.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    from studies.verification.layouts import launch_local

    args = parse_args(argv)
    if args.seq % (2 * args.cp):
        print(
            f"bench_cp_balance: --seq {args.seq} is not divisible by 2·cp = {2 * args.cp}; "
            f"choose a multiple of {2 * args.cp}",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as args.record_dir:
        every = launch_local(_rank, args.cp, args)
        alone = _alone([path for _, path in every], args.replays)
    print(
        f"cp {args.cp}, causal, {args.seq} tokens, {args.heads} heads of {args.head_dim}, fp32, "
        f"1 thread per rank; attention CPU s per forward+backward, median of {args.repeats}"
    )
    print(f"rank  load-balanced  contiguous  load-balanced alone (least of {args.replays} replays)")
    medians = []
    for rank, (times, _) in enumerate(every):
        row = (*(statistics.median(t[i] for t in times) for i in range(2)), alone[rank])
        medians.append(row)
        print(f"{rank:4d}  {row[0]:13.3f}  {row[1]:10.3f}  {row[2]:13.3f}")
    names = ("load-balanced", "contiguous", "load-balanced alone")
    for i, name in enumerate(names):
        column = [m[i] for m in medians]
        if min(column) > 0:
            print(f"{name}: busiest ÷ least busy = {max(column) / min(column):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
