"""Benchmark the fused kernels against torch eager, torch.compile, Liger-Kernel and apex.

    python tools/bench_kernels.py --out outputs/bench_kernels            # on a CUDA machine
    python tools/bench_kernels.py --smoke --out outputs/bench_smoke      # anywhere: tiny shapes

The benchmark lives in studies/bench/kernels.py (what it measures and writes is described there).
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.kernels import main, parse_args  # noqa: E402, F401


def cli() -> None:
    """The command line: the rows go to ``--out``; ``main`` also returns them, for tests."""
    main()


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(cli)
