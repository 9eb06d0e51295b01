"""Measure this machine for the performance model and write a cluster spec YAML.

    python tools/calibrate.py --model gpt_tiny --seq 128 --out configs/cluster/cpu_2core.yaml
    python tools/calibrate.py --quick --out here.yaml          # what the CI test runs: checks the pipeline

On CPU it measures one thread's GEMM throughput at the model's shapes (and what a second
thread adds), streaming bandwidth, host time per autograd operator, and gloo all-reduce /
all-gather times over 2..N processes, fitted to latency + bytes/bandwidth. On a GPU it
measures the GPU's GEMMs (bf16) and bandwidth; links are measured with NCCL only when
several GPUs are visible, else the datasheet values of --base are kept.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.perfmodel.calibrate import build_parser, main  # noqa: E402


def parse_args(argv: list[str] | None = None):
    """The command line (the README test parses every command shown with it)."""
    return build_parser().parse_args(argv)


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(
        lambda: main(
            sys.argv[1:], description=__doc__, formatter=argparse.RawDescriptionHelpFormatter
        )
    )
