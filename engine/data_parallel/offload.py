"""``parallel.offload=optimizer`` for ZeRO-1: this rank's fp32 master slices and Adam's
moments live in host memory, and torch's AdamW steps them there.

One step, per bucket, after clipping (which still scales the averaged gradient slice on
the device, where the norm was taken):

1. the gradient slice is copied to a host buffer of its own (the master's ``.grad``);
2. AdamW updates the host masters (its moments are made beside them, on the host);
3. each updated master is copied (cast to the parameters' dtype) into this rank's slice
   of the bucket's parameter buffer, which the all-gather then spreads.

The host buffers are pinned where CUDA is available, so the copies can run as DMA; on a
CPU-only machine they are plain CPU tensors, still separate from the parameters, so the
path runs (and is tested) everywhere. The device keeps no master and no moment: for
fp32 parameters the device-side "master" is this rank's slice of the parameter buffer (as
without offload), for bf16 ones a zero-stride placeholder that only carries the gradient
slice for the norm and the clip.

FSDP (``dp_shard=gradients|full``) offloads through torch's own ``CPUOffloadPolicy``
instead (engine/data_parallel/fsdp.py), which moves parameters and gradients too.
"""

from __future__ import annotations

import torch

from engine.data_parallel.buckets import ShardedBucket


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized host tensor of ``t``'s shape and dtype, pinned when CUDA is there."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())


class HostMasters:
    """The host copies of ZeRO-1's master slices (one per bucket) that the optimizer steps."""

    def __init__(self, buckets: list[ShardedBucket]) -> None:
        self.buckets = buckets
        self.masters = [host_empty_like(b.master) for b in buckets]
        for b, host in zip(buckets, self.masters, strict=True):
            host.copy_(b.master)
            host.grad = host_empty_like(b.master)
            if not b.shared_master:
                # The device master is no longer stepped: a zero-stride fp32 placeholder
                # of its shape carries the gradient slice; the host master feeds the
                # parameter buffer (launch_gather copies nothing more).
                b.master = torch.zeros((), dtype=b.dtype, device=b.master.device).expand(
                    b.master.shape
                )
                b.shared_master = True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients to the host, ``optimizer`` (over ``masters``) steps, masters back."""
        for b, host in zip(self.buckets, self.masters, strict=True):
            host.grad.copy_(b.master.grad, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the gradients have arrived before AdamW reads them
        optimizer.step()
        for b, host in zip(self.buckets, self.masters, strict=True):
            b.slice(b.param_buffer).copy_(host, non_blocking=True)

    def nbytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Host bytes: the masters, their gradient buffers and the optimizer's state."""
        tensors = [t for host in self.masters for t in (host, host.grad)]
        tensors += [v for st in optimizer.state.values() for v in st.values() if v.dim()]
        return sum(t.nbytes for t in tensors)
