"""``FreshBuffers``: which ops allocate new memory of a given size (copy-counting tests)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class FreshBuffers(TorchDispatchMode):
    """Records the name of every op that returns new memory (not a view of, or an in-place
    write into, one of its inputs) of at least ``numel`` elements, in ``ops``."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
            if fresh and t.numel() >= self.numel:
                self.ops.append(func.overloadpacket.__name__)
        return out
