"""Learning-rate schedule, fp16 loss scaling and AdamW parameter groups."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from engine.config import OptimConfig
from engine.data_parallel import DynamicLossScaler, clip_grads_, global_grad_norm
from engine.data_parallel import grads as grads_module
from engine.optim import build_optimizer, lr_at


def test_warmup_then_cosine_by_hand():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    # Warmup: lr·(step+1)/warmup, so the first step already moves.
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # Cosine over the remaining 10 steps: min + (max − min)·(1 + cos(π·k/10))/2.
    for k in (0, 3, 5, 10):
        expected = 0.1 + 0.9 * (1 + math.cos(math.pi * k / 10)) / 2
        assert lr_at(4 + k, cfg, 14) == pytest.approx(expected, rel=1e-12)
    assert lr_at(100, cfg, 14) == pytest.approx(0.1)  # stays at min_lr past the end


def test_loss_scaler_skips_overflow_and_adapts():
    scaler = DynamicLossScaler(1024.0, growth_interval=2)
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.found_overflow([p])
    scaler.update(True)
    assert scaler.scale == 512.0  # halved on overflow
    p.grad = torch.tensor([512.0, 1024.0, 0.0])
    assert not scaler.found_overflow([p])
    scaler.unscale_([p])
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 0.0]))
    scaler.update(False)
    assert scaler.scale == 512.0
    scaler.update(False)
    assert scaler.scale == 1024.0  # doubled after growth_interval good steps


def test_weight_decay_only_on_matrices_and_clipping():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([3, 4])] and decay[
        "weight_decay"
    ] == 0.1
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    clip_grads_(params, 1.0, torch.tensor(4.0))  # norm 4 → scale by 1/4 (minus 1e-6 guard)
    assert params[0].grad[0, 0].item() == pytest.approx(0.5, rel=1e-6)


def test_apex_requested_without_apex_is_a_clear_error():
    if importlib.util.find_spec("apex") is not None:
        pytest.skip("apex is installed here, so there is nothing to refuse")
    with pytest.raises(RuntimeError, match="optim.impl=apex but apex is not importable"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(impl="apex"), torch.device("cpu"))


def _host_syncs(fn) -> int:
    """How many times ``fn`` reads a device value back to Python (``.item()``, ``bool()``,
    ``float()``: each is an ``aten::_local_scalar_dense``, a host sync on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


def test_fused_norm_matches_float64_and_never_syncs(monkeypatch):
    """The multi-tensor norm that CUDA uses (here forced on CPU tensors): within 1e-6 of
    float64 sqrt(sum g²) (fp32 accumulation, one rounding of each tensor's norm squared
    back), fp32 and bf16 gradients alike, with no read-back to the host."""
    monkeypatch.setattr(grads_module, "FUSED_NORM_DEVICES", ("cpu",))
    gen = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.zeros(33, 17)) for _ in range(6)]
    params += [nn.Parameter(torch.zeros(65, dtype=torch.bfloat16)) for _ in range(6)]
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape, generator=gen) * (i + 1)).to(p.dtype)
    want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))
    assert global_grad_norm(params, None).item() == pytest.approx(want, rel=1e-6)
    assert _host_syncs(lambda: global_grad_norm(params, None)) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_norm_of_cuda_gradients_matches_float64():
    """On CUDA the norm takes the multi-tensor kernel (``FUSED_NORM_DEVICES``): within 1e-6
    of float64 sqrt(sum g²) (fp32 accumulation, one rounding per tensor squared back)."""
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(257, 129, generator=gen) for _ in range(5)]
    grads += [torch.randn(1000, generator=gen).to(torch.bfloat16) for _ in range(5)]
    params = [nn.Parameter(torch.zeros_like(g, device="cuda")) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to("cuda")
    want = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
    assert global_grad_norm(params, None).item() == pytest.approx(want, rel=1e-6)


def test_norm_and_clipping_are_exact_and_never_sync():
    """The global norm equals float64 sqrt(sum g²) (1e-6: fp32 partial sums), clipping scales
    by exactly Python's min(1, max_norm / (norm + 1e-6)) (bitwise, fp32 and bf16), and
    neither reads a value back to the host; the fp16 overflow check reads back once for
    20 parameters, not once per parameter."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(5, 7)) for _ in range(10)]
    params += [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(10)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))
    norm = global_grad_norm(params, None)
    assert norm.item() == pytest.approx(want, rel=1e-6)
    expected = [p.grad.clone().mul_(min(1.0, 1.0 / (norm.item() + 1e-6))) for p in params]
    clip_grads_(params, 1.0, norm)
    for p, e in zip(params, expected, strict=True):
        assert torch.equal(p.grad, e)
    assert _host_syncs(lambda: clip_grads_(params, 1.0, global_grad_norm(params, None))) == 0
    scaler = DynamicLossScaler(2.0**16)
    assert _host_syncs(lambda: scaler.found_overflow(params)) == 1
