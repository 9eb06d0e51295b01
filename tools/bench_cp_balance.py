"""Per-rank attention compute of ring attention's load-balanced causal layout at cp N, on N
local ranks, and the ratio busiest ÷ least busy (with a contiguous split's beside it).

    python tools/bench_cp_balance.py --cp 4 --seq 4096 --heads 4 --head-dim 64

The benchmark lives in studies/bench/cp_balance.py.
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.cp_balance import main  # noqa: E402

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
