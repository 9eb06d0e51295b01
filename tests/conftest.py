"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)
    yield
