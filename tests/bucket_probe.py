"""``LaunchProbe``: how many buckets a bucket launcher (GradSync, ZeRO-1) had launched when
backward reached a given point (overlap tests)."""

from __future__ import annotations

import torch


class LaunchProbe(torch.autograd.Function):
    """Identity whose backward records how many buckets ``launcher`` had already launched
    (its ``_next_launch``) into ``record``."""

    @staticmethod
    def forward(ctx, x, launcher, record):
        ctx.launcher, ctx.record = launcher, record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.record.append(ctx.launcher._next_launch)
        return grad, None, None
