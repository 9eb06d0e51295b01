"""Training throughput: tokens/s, model TFLOP/s and MFU of meshtron, against plain PyTorch.

    python tools/bench_train.py --preset gpt_tiny --hidden 256 --layers 4 --heads 4 \\
        --seq 128 --micro-batch 8 --vocab 8192 --threads 1 --out bench_train.csv
    torchrun --nproc-per-node 2 tools/bench_train.py --dp 2 --zero1 ...  # ZeRO-1 ÷ all-reduce

The benchmark lives in studies/bench/train.py (what it times and how is described there).
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.train import main, parse_args  # noqa: E402, F401

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
