"""Scaling study over tp × dp × nodes on real processes: ``python tools/scaling_study.py --help``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.scaling.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
