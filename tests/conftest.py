"""Shared pytest setup."""

import os

import pytest
import torch

# Triton decides at import whether to interpret. Without a GPU, kernels can only run under
# its interpreter, so set it before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)
    yield
