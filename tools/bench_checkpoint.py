"""Checkpoint save and load time of meshtron against torch DCP, torch.save and safetensors.

    python tools/bench_checkpoint.py --preset gpt_125m --rounds 3

The benchmark lives in studies/bench/checkpoint.py (what it times and how is described there).
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.checkpoint import main, parse_args  # noqa: E402, F401

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
