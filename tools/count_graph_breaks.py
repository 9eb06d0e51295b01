"""Graphs and graph breaks of meshtron's compiled training step (model.compile=true).

    python tools/count_graph_breaks.py --preset gpt_tiny --recompute full
    torchrun --nproc-per-node 2 tools/count_graph_breaks.py --tp 2 --sequence-parallel

The counting lives in studies/bench/graph_breaks.py.
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.graph_breaks import main, parse_args  # noqa: E402, F401

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
