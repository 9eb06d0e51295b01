"""Pieces the kernel tests share: the table of worst errors each prints at the end of its
module (with -s, so that a tolerance's margin can be read off a run), and what autograd
saves for a kernel's backward."""

from __future__ import annotations

from collections.abc import Callable

import torch


def print_max_errors(title: str, max_err: dict[str, float | tuple[float, ...]], width: int):
    """``title``, then one row a key (sorted, padded to ``width``): its error or errors."""
    print(f"\n{title}")
    for key in sorted(max_err):
        errors = max_err[key] if isinstance(max_err[key], tuple) else (max_err[key],)
        print(f"  {key:<{width}} " + "  ".join(f"{e:.3e}" for e in errors))


def saved_for_backward(forward: Callable[[], object]) -> list[torch.Tensor]:
    """The tensors autograd saves while ``forward()`` runs, in the order it saves them."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        forward()
    return saved
