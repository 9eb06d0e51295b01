"""Benchmarks behind tools/bench_*.py: what they build, time, check and write."""
