"""Check the performance model against this machine or against published results.

    python tools/validate_perfmodel.py machine --cluster configs/cluster/cpu_2core.yaml --rounds 2
    python tools/validate_perfmodel.py scaling --csv study/results.csv --cluster emulated_1gbit \\
        --compute-from cpu_2core --hidden 128 --layers 2 --heads 4 --vocab 8192 --seq 128
    python tools/validate_perfmodel.py published

``machine`` runs engine.pretrain (tiny GPT, fp32) at the layouts of ``MACHINE_POINTS``,
measures the median step time (``--rounds N``: the median over N rounds) and prints
measured vs predicted with errors; ``scaling`` prices the points of a scaling study
(``--no-overlap`` for a study run with trainer.overlap_grad_reduce=false).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.perfmodel.validate_cli import build_parser, main  # noqa: E402


def parse_args(argv: list[str] | None = None):
    """The command line (the README test parses every command shown with it)."""
    return build_parser().parse_args(argv)


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
