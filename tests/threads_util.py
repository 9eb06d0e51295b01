"""Torch's intra-op thread count, changed for a block of tests and set back after it."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(count: int):
    """``count`` intra-op threads inside the block, the count before it after it: tests of
    many tiny matmuls run faster on one, with no threads waiting for a shared core."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
