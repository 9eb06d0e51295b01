"""MoE layer speed: meshtron's MoEMLP against transformers' Mixtral block on the same
weights and tokens, and the expert-parallel dispatch overhead at ep 2 against ep 1.

    python tools/bench_moe.py                                  # both parts
    python tools/bench_moe.py --only ep --tokens 512 --json moe.json

The benchmark lives in studies/bench/moe.py (what it runs and checks is described there).
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.moe import main  # noqa: E402

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
