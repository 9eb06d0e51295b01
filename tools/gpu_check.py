"""Everything the CPU cannot measure, in one budgeted run on a GPU machine.

    python3 tools/gpu_check.py --out DIR        # on one GPU: 480 s by default
    python tools/gpu_check.py --rehearse --out DIR

The items, their order, caps and outputs are described in studies/bench/gpu_check.py
and by ``--help``.
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.gpu_check import main, parse_args  # noqa: E402, F401

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
