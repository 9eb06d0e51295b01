"""Where an element-wise op's forward+backward time goes on a GPU: kernels or the host.

For LayerNorm, bias-GeLU and bias-dropout-add, Triton and torch, it prints three times per
fwd+bwd call: ``triton.testing.do_bench``'s median (what tools/bench_kernels.py reports),
the host time of 50 calls issued back to back (Python, autograd and launches), and the sum
of the GPU kernels' times from ``torch.profiler``. When the host time exceeds the kernel
time, the op alone is bound by the host, and a model hides that only if its GEMMs are long
enough for the host to run ahead.

    python tools/bench_kernel_host.py --tokens 16384 --hidden 1024 2048 4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--calls", type=int, default=50, help="calls timed on the host")
    return p.parse_args(argv)


def _kernel_ms(fn, calls: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def _host_ms(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def _rows(tokens: int, n: int, calls: int):
    """(op, backend, do_bench ms, host ms per call, GPU kernel ms per call) at width n."""
    from triton.testing import do_bench

    from layers.kernels import bias_dropout_add, bias_gelu, layer_norm

    make = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x, r = torch.randn(tokens, n, **make), torch.randn(tokens, n, **make)
    w, b = torch.randn(n, **make), torch.randn(n, **make)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    ops = {
        "layer_norm": lambda be: layer_norm(x, w, b, 1e-5, backend=be),
        "bias_gelu": lambda be: bias_gelu(x, b, backend=be),
        "bias_dropout_add": lambda be: bias_dropout_add(x, b, r, 0.1, True, backend=be),
    }
    for name, op in ops.items():
        for backend in ("triton", "torch"):

            def call(op=op, backend=backend):
                op(backend).backward(dy)

            bench = do_bench(call, grad_to_none=[x, w, b, r], return_mode="median")
            yield name, backend, bench, _host_ms(call, calls), _kernel_ms(call, 5)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernel_host.py: needs a CUDA GPU (it times GPU kernels)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print("op               h      impl    do_bench ms   host ms/call   GPU kernels ms/call")
    for n in args.hidden:
        for name, backend, bench, host, kernels in _rows(args.tokens, n, args.calls):
            print(f"{name:16s} {n:<6d} {backend:7s} {bench:11.3f} {host:14.3f} {kernels:21.3f}")
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
