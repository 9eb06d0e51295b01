"""Step time of each pipeline schedule at pp 2 or 4 (1F1B, interleaved, zero bubble, ZB-V,
DualPipeV), side by side in one run on --pp local ranks.

    python tools/bench_pipeline.py --steps 10 --microbatches 8

The benchmark lives in studies/bench/pipeline_schedules.py.
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.pipeline_schedules import main  # noqa: E402

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
