"""Serving under load: the server's continuous batching against static batching.

    python tools/bench_serve.py                       # 64 clients, 512 requests, batch 16
    python tools/bench_serve.py --clients 4 --requests 8 --batch 4 --hidden 32 --vocab 300

Concurrent HTTP clients against ``python -m apps.serve``, then the same requests through
the serving engine continuously and in static batches, and one at a time; every answer
checked against sequential generation. The benchmark lives in studies/bench/serve.py
(what it runs and checks is described there).
"""

import os
import sys

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.bench.serve import main, parse_args  # noqa: E402, F401

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
