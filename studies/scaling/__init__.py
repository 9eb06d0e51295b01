"""Scaling studies: the emulated cluster, the point runner, reports (tools/scaling_study.py)."""
