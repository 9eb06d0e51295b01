"""A whole tiny GPT with the fused Triton kernels on and off: same loss, same gradients.

The single-process test runs on CUDA when it is present (compiled kernels), else on CPU
under TRITON_INTERPRET=1 (tests/conftest.py sets it). The TP=2 tests run gloo ranks on CPU
tensors, started with TRITON_INTERPRET=1 in their environment (triton fixes interpreted or
compiled when first imported, so a CUDA machine's pytest process cannot interpret). Dropout is 0 because the two
backends draw their masks from different generators (Philox in the kernel, torch's own
generator in F.dropout) — equal in distribution, not in value.

Tolerance 2e-5 relative (max |Δ| / max |ref| per tensor) in fp32: both paths accumulate
in fp32, but the kernels reduce LayerNorm statistics and parameter gradients in a
different order, and the error of each op (≤ ~3e-6 each, measured in test_kernels.py)
compounds through two layers, the LM head and the cross-entropy.
"""

from __future__ import annotations

import pytest
import torch

import parallel_state
from engine.models import build_model
from engine.models.config import preset
from tests.multiproc import run_ranks
from tests.torch_reference import relative_errors, tiny_gpt

TOL = 2e-5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETER = {"TRITON_INTERPRET": "1"}


def _loss_and_grads(kernels: str, sequence_parallel: bool = False, device="cpu"):
    ps = parallel_state.get() if parallel_state.is_initialized() else None
    cfg = tiny_gpt(300, num_layers=2, kernels=kernels, sequence_parallel=sequence_parallel)
    if ps is not None:
        ps.seed(5)
    else:
        torch.manual_seed(5)
    model = build_model(cfg, device=device)
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiny_gpt_same_with_and_without_kernels():
    errors = relative_errors(
        _loss_and_grads("torch", device=DEVICE), _loss_and_grads("triton", device=DEVICE)
    )
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"
    # The kernels reduce in another order than torch, so a bitwise-equal result would mean
    # the Triton path never ran.
    assert errors[worst] > 0


def _both(sequence_parallel: bool) -> dict[str, float]:
    parallel_state.initialize(2)
    return relative_errors(
        _loss_and_grads("torch", sequence_parallel), _loss_and_grads("triton", sequence_parallel)
    )


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tiny_gpt_kernels_at_tp2(sequence_parallel):
    """The kernels inside a TP=2 model (fused cross-entropy with its all-reduces, SP norms)."""
    for errors in run_ranks(_both, 2, sequence_parallel, env=INTERPRETER):
        worst = max(errors, key=errors.get)
        assert 0 < errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"


def test_unknown_kernels_choice_is_rejected():
    with pytest.raises(ValueError, match="model.kernels='cuda' is not one of"):
        preset("gpt_tiny", kernels="cuda").validate(1)
