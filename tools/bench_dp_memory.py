"""Training state held per rank under each DP mode (all-reduce, FSDP, HSDP, FSDP with the
optimizer offloaded), side by side on one model at one dp.

    python tools/bench_dp_memory.py --dp 4 --replicas 2

The benchmark lives in studies/bench/dp_state_memory.py (what it counts is described there).
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.dp_state_memory import main  # noqa: E402

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
