"""Data parallelism: every DP collective of a training step lives in this package.

- ``grad_sync``: bucketed gradient all-reduce overlapping backward (and the TP sum of
  sequence-parallel gradients);
- ``zero``: ZeRO-1, bucketed reduce-scatter / all-gather with sharded master weights
  (``buckets``: its flat parameter and gradient buffers and their collectives);
- ``grads``: the global gradient norm, clipping and fp16 overflow agreement;
- ``fsdp``: ZeRO-2 and ZeRO-3 through PyTorch's FSDP2, per transformer layer;
- ``interface``: what every strategy presents to the trainer and the checkpoints;
- ``strategy``: one object per mode behind that interface, chosen once by
  :func:`build_data_parallel`.
"""

from engine.data_parallel.grad_sync import GradSync
from engine.data_parallel.grads import DynamicLossScaler, clip_grads_, global_grad_norm
from engine.data_parallel.interface import DataParallel, PlainOptimizerState
from engine.data_parallel.strategy import (
    AllReduceDP,
    BucketedSync,
    Zero1DP,
    build_data_parallel,
    checkpoint_view,
)
from engine.data_parallel.zero import MASTER_KEY, ZeroOptimizer

__all__ = [
    "MASTER_KEY",
    "AllReduceDP",
    "BucketedSync",
    "DataParallel",
    "DynamicLossScaler",
    "FullyShardedDP",
    "GradSync",
    "PlainOptimizerState",
    "Zero1DP",
    "ZeroOptimizer",
    "build_data_parallel",
    "checkpoint_view",
    "clip_grads_",
    "global_grad_norm",
]


def __getattr__(name: str):
    """``FullyShardedDP`` on first use: importing torch's FSDP2 costs ~1 s of CPU in every
    process, and only the gradients and full modes need it."""
    if name == "FullyShardedDP":
        from engine.data_parallel.fsdp import FullyShardedDP

        return FullyShardedDP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
