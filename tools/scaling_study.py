"""Scaling study over tp × dp × nodes on real processes: ``python tools/scaling_study.py --help``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.scaling.study_cli import main, parse_args  # noqa: E402, F401 (parse_args: README test)

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
