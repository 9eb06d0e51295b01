"""The fused Triton kernels (layers.kernels) against torch references, forward and every gradient.

Kernel tests run on ``DEVICE``: compiled on CUDA tensors when CUDA is present, else in the
Triton interpreter on CPU tensors. For that this module sets ``TRITON_INTERPRET=1`` before
anything imports triton (``layers.kernels`` imports triton only when a kernel first runs),
and ``test_interpreter_is_really_used`` checks it took. Triton fixes the mode for the whole
process when it is first imported, so on a CUDA machine the multi-rank tests, whose gloo
ranks hold CPU tensors, start their ranks with ``TRITON_INTERPRET=1`` in the environment
(``run_ranks(..., env=INTERPRETER)``).
The interpreter runs Python per program instance, so shapes are small and block sizes
are chosen (by the launchers) so each case launches few programs; big shapes are
``@pytest.mark.gpu``.

Tolerances:
- fp32: ``assert_close(kernel, torch_float64, rtol=1e-5, atol=1e-5 * max(1, max|ref|))``,
  the torch op run in float64 on the same inputs. fp32 accumulation over rows of <= 4099
  terms costs a few ulps (~1e-7) times the sum length, far inside 1e-5. The absolute part
  grows with the tensor's largest magnitude because a gradient summed over rows (LayerNorm's
  weight gradient over 4096 rows of values near 100, on the GPU shapes) can come out near
  zero by cancellation while its rounding error follows the size of the summed terms: an
  error of 1e-5 of the largest value is still ~80 fp32 ulps of it. The reference is float64 rather
  than torch fp32 because for degenerate rows torch fp32 is the one that is off: with one
  column x - mean is exactly 0, yet torch's fp32 LayerNorm weight gradient comes out
  ~2e-5 (rounding amplified by rstd = 1/sqrt(eps) ~ 316) where the kernel gives 0.
- bf16 / fp16: the kernel's error and the error of the same torch op run in that low
  precision are both measured against a float64 reference computed from the same
  (low-precision) inputs; the kernel must satisfy ``err_kernel <= 2 * err_torch_lowp +
  ulp``, where ulp is the dtype's eps times the largest |reference| value. A fused kernel
  that accumulates in fp32 and rounds once should be at least as accurate as torch's
  low-precision op (which rounds at every step, or, like CPU LayerNorm, also computes in
  fp32); the factor 2 allows a different but equally valid rounding, and the ulp floor
  covers cases where both are exact (e.g. a single column). The floor also covers an
  interpreter artifact: triton 3.9's interpreter converts fp32 to bf16 by truncation, so
  interpreted bf16 outputs can be one ulp off where torch (and the GPU, which rounds to
  nearest even) are within half an ulp.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; see the module docstring

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import layers.kernels as kernels  # noqa: E402
import parallel_state  # noqa: E402
from layers import copy_to_tp, vocab_parallel_cross_entropy  # noqa: E402
from layers.fused_cross_entropy import (  # noqa: E402
    fused_linear_cross_entropy,
    fused_vocab_parallel_cross_entropy,
)
from layers.kernels import (  # noqa: E402
    LayerNorm,
    bias_dropout_add,
    bias_gelu,
    layer_norm,
    use_triton,
)
from tests.kernel_util import print_max_errors, saved_for_backward  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402

# The environment of ranks that run the kernels on CPU tensors (see the module docstring).
INTERPRETER = {"TRITON_INTERPRET": "1"}

# tl.sigmoid of a very negative argument overflows exp to inf in the interpreter's numpy and
# correctly gives 0; numpy warns about the inf.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS, COLS = (1, 7, 33), (1, 127, 1000, 4099)
SHAPES = [(m, n) for m in ROWS for n in COLS]
# Low precision on a subset: the interpreter is slow and rounding does not depend on size.
LOWP_SHAPES = [(1, 1), (7, 127), (33, 1000), (33, 4099)]
LOWP = (torch.bfloat16, torch.float16)
CASES = [(s, torch.float32) for s in SHAPES] + [(s, d) for s in LOWP_SHAPES for d in LOWP]
GELU_CASES = (
    [(s, torch.float32, a) for s in SHAPES for a in ("tanh", "none")]
    + [(s, d, "tanh") for s in LOWP_SHAPES for d in LOWP]
    + [((7, 127), d, "none") for d in LOWP]
)  # the interpreter's erf is a per-element Python call
# The interpreter's Philox costs ~0.5 s per pass over 33 x 4099, so dropout leaves out that
# one shape (its rows and its columns are both covered by other shapes).
DROPOUT_CASES = [(s, d) for s, d in CASES if s != (33, 4099)]
# Worst |kernel - float64 reference| per op/tensor/dtype, and the same for torch in that dtype.
MAX_ERR: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_max_errors():
    yield
    title = "max |x - float64 reference|      kernel     torch (same dtype)"
    print_max_errors(title, MAX_ERR, width=36)


def check(name: str, got: torch.Tensor, torch_out: torch.Tensor, ref64: torch.Tensor) -> None:
    """Compare a kernel output or gradient; tolerances in the module docstring."""
    got, torch_out, ref64 = got.detach(), torch_out.detach(), ref64.detach().double()
    assert got.dtype == torch_out.dtype, f"{name}: dtype {got.dtype} vs torch {torch_out.dtype}"
    err = (got.double() - ref64).abs().max().item() if got.numel() else 0.0
    torch_err = (torch_out.double() - ref64).abs().max().item() if got.numel() else 0.0
    key = f"{name} {str(got.dtype).removeprefix('torch.')}"
    worst = MAX_ERR.get(key, (0.0, 0.0))
    MAX_ERR[key] = (max(worst[0], err), max(worst[1], torch_err))
    if got.dtype == torch.float32:
        scale = max(1.0, ref64.abs().max().item()) if got.numel() else 1.0
        torch.testing.assert_close(
            got, ref64.float(), rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}"
        )
        return
    ulp = torch.finfo(got.dtype).eps * ref64.abs().max().item() if got.numel() else 0.0
    bound = 2 * torch_err + ulp
    torch.testing.assert_close(
        got.double(),
        ref64,
        rtol=0,
        atol=bound,
        msg=lambda m: (
            f"{name}: kernel err {err:.3e} > 2 x torch {got.dtype} err "
            f"{torch_err:.3e} + ulp {ulp:.3e}\n{m}"
        ),
    )


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def run(fn, inputs, dy):
    """fn(*inputs) and the gradients of <out, dy> with respect to every input."""
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, dy)


def compare(name, fn_kernel, fn_torch, inputs, dy, grad_names):
    """Kernel vs torch in the inputs' dtype vs torch in float64, forward and all gradients."""
    got, got_g = run(fn_kernel, leaves(*inputs), dy)
    ref, ref_g = run(fn_torch, leaves(*inputs), dy)
    exact, exact_g = run(fn_torch, leaves(*(t.double() for t in inputs)), dy.double())
    check(f"{name} out", got, ref, exact)
    for g_name, g, r, e in zip(grad_names, got_g, ref_g, exact_g, strict=True):
        check(f"{name} d{g_name}", g, r, e)


def test_interpreter_is_really_used():
    """On CPU the kernels must be interpreted; triton decides that when first imported."""
    if DEVICE.type == "cuda":
        pytest.skip("CUDA present: kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    from layers.kernels.layer_norm_triton import _layer_norm_fwd_kernel

    assert isinstance(_layer_norm_fwd_kernel, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set; set it in the environment"
    )
    assert use_triton(torch.zeros(1), "auto")


# ---------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("shape,dtype", CASES, ids=str)
def test_layer_norm(shape, dtype):
    m, n = shape
    x = torch.randn(m, n, device=DEVICE).mul(3).add(1).to(dtype)  # mean and scale != 0, 1
    w, b = torch.randn(n, device=DEVICE).to(dtype), torch.randn(n, device=DEVICE).to(dtype)
    dy = torch.randn(m, n, device=DEVICE).to(dtype)
    compare(
        "layer_norm",
        lambda x, w, b: layer_norm(x, w, b, 1e-5, backend="triton"),
        lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5),
        (x, w, b),
        dy,
        ("x", "weight", "bias"),
    )


@pytest.mark.parametrize("affine", ["weight", "none"])
def test_layer_norm_without_weight_or_bias(affine):
    x, dy = torch.randn(2, 3, 127, device=DEVICE), torch.randn(2, 3, 127, device=DEVICE)
    w = torch.randn(127, device=DEVICE) if affine == "weight" else None
    (xk,), (xr,) = leaves(x), leaves(x)
    yk, yr = layer_norm(xk, w, None, backend="triton"), F.layer_norm(xr, (127,), w, None)
    torch.testing.assert_close(yk, yr, rtol=1e-5, atol=1e-5)
    yk.backward(dy), yr.backward(dy)
    torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-5, atol=1e-5)


def test_layer_norm_fp32_weights_with_bf16_activations():
    """Mixed dtypes: output in x's dtype, weight gradients in the weights' dtype; within one
    bf16 ulp of float64 (the fp32 statistics are exact to far better than that)."""
    x = (torch.randn(7, 127, device=DEVICE) * 2).to(torch.bfloat16).requires_grad_()
    w, b = leaves(torch.randn(127, device=DEVICE), torch.randn(127, device=DEVICE))
    y = layer_norm(x, w, b, backend="triton")
    y.sum().backward()
    assert y.dtype == x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    xe, we, be = leaves(x.double(), w.double(), b.double())
    ye = F.layer_norm(xe, (127,), we, be)
    ye.sum().backward()
    ulp = torch.finfo(torch.bfloat16).eps * ye.abs().max().item()
    torch.testing.assert_close(y.double(), ye, rtol=0, atol=ulp)
    torch.testing.assert_close(w.grad.double(), we.grad, rtol=1e-5, atol=1e-5)


def test_layer_norm_module_matches_torch_layer_norm():
    ref = torch.nn.LayerNorm(64, eps=1e-6, device=DEVICE)
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    fused = LayerNorm(64, eps=1e-6, device=DEVICE, backend="triton")
    assert fused.state_dict().keys() == ref.state_dict().keys() == {"weight", "bias"}
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 64, device=DEVICE)
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
    fused(x).sum().backward(), ref(x).sum().backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(
            getattr(fused, name).grad, getattr(ref, name).grad, rtol=1e-5, atol=1e-5
        )


# ---------------------------------------------------------------- bias + GeLU


@pytest.mark.parametrize("shape,dtype,approximate", GELU_CASES, ids=str)
def test_bias_gelu(shape, dtype, approximate):
    m, n = shape
    x = torch.randn(m, n, device=DEVICE).mul(2).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    dy = torch.randn(m, n, device=DEVICE).to(dtype)
    compare(
        f"bias_gelu[{approximate}]",
        lambda x, b: bias_gelu(x, b, approximate, backend="triton"),
        lambda x, b: F.gelu(x + b, approximate=approximate),
        (x, b),
        dy,
        ("x", "bias"),
    )


def test_bias_gelu_without_bias_and_saves_only_inputs():
    x = torch.randn(4, 33, device=DEVICE, requires_grad=True)
    b = torch.randn(33, device=DEVICE, requires_grad=True)
    saved = saved_for_backward(lambda: bias_gelu(x, b, backend="triton"))
    # Backward recomputes x + b: exactly x and b are saved, nothing output-sized besides.
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), b.data_ptr()]
    torch.testing.assert_close(
        bias_gelu(x, None, "none", backend="triton"), F.gelu(x), rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------- bias + dropout + add


SEED = 1234


def dropout_inputs(shape, dtype):
    m, n = shape
    x, res, dy = (torch.randn(m, n, device=DEVICE).to(dtype) for _ in range(3))
    return x, torch.randn(n, device=DEVICE).to(dtype), res, dy


def kernel_mask(shape, p, seed=SEED):
    """The kept elements of the kernel's mask for ``seed``: it depends on seed and shape only."""
    ones = torch.ones(shape, device=DEVICE)
    return (
        bias_dropout_add(ones, None, torch.zeros_like(ones), p, True, seed, backend="triton") != 0
    )


def fused_dropout(p, seed=SEED, training=True):
    return lambda x, b, r: bias_dropout_add(x, b, r, p, training, seed, backend="triton")


@pytest.mark.parametrize("shape,dtype", DROPOUT_CASES, ids=str)
def test_bias_dropout_add_against_its_own_mask(shape, dtype):
    """Forward and every gradient against torch applying the same mask and scale."""
    p = 0.3
    x, b, res, dy = dropout_inputs(shape, dtype)
    mask = kernel_mask(shape, p)
    compare(
        "bias_dropout_add",
        fused_dropout(p),
        lambda x, b, r: r + (x + b) * mask.to(x.dtype) * (1.0 / (1.0 - p)),
        (x, b, res),
        dy,
        ("x", "bias", "residual"),
    )


def test_dropout_same_seed_same_mask_and_grads():
    """Recomputation reproduces output and gradients bit for bit: from the same explicit
    seed, and from seed=None after restoring the generator (what activation recompute does)."""
    x, b, res, dy = dropout_inputs((7, 1000), torch.float32)
    first = run(fused_dropout(0.5, seed=7), leaves(x, b, res), dy)
    again = run(fused_dropout(0.5, seed=7), leaves(x, b, res), dy)
    other = run(fused_dropout(0.5, seed=8), leaves(x, b, res), dy)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])
    # seed=None draws from the generator of x's device: save and restore that one.
    cuda = DEVICE.type == "cuda"
    state = torch.cuda.get_rng_state(DEVICE) if cuda else torch.get_rng_state()
    drawn = run(fused_dropout(0.5, seed=None), leaves(x, b, res), dy)
    torch.cuda.set_rng_state(state, DEVICE) if cuda else torch.set_rng_state(state)
    redrawn = run(fused_dropout(0.5, seed=None), leaves(x, b, res), dy)
    torch.testing.assert_close(drawn, redrawn, rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_fraction_and_exact_scaling(p):
    """The dropped fraction is within 6 binomial standard deviations sqrt(p(1-p)/n) of p (a
    false failure has probability ~2e-9); kept elements are (x + b) * fp32(1/(1-p)) exactly,
    in forward and, times dy, in backward."""
    x, b, res, dy = dropout_inputs((33, 1000), torch.float32)
    kept = kernel_mask(x.shape, p)
    dropped = 1.0 - kept.double().mean().item()
    assert abs(dropped - p) <= 6 * (p * (1 - p) / kept.numel()) ** 0.5, f"dropped {dropped}"
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    out, (dx, db, dres) = run(fused_dropout(p), leaves(x, b, torch.zeros_like(res)), dy)
    torch.testing.assert_close(out, torch.where(kept, (x + b) * scale, 0.0), rtol=0, atol=0)
    torch.testing.assert_close(dx, torch.where(kept, dy * scale, 0.0), rtol=0, atol=0)
    torch.testing.assert_close(dres, dy, rtol=0, atol=0)


def test_dropout_off_and_edge_probabilities():
    x, b, res, dy = dropout_inputs((7, 127), torch.float32)
    for p, training in ((0.0, True), (0.5, False)):
        out, (dx, db, dres) = run(fused_dropout(p, training=training), leaves(x, b, res), dy)
        torch.testing.assert_close(out, res + (x + b), rtol=0, atol=0)
        torch.testing.assert_close(dx, dy, rtol=0, atol=0)
        torch.testing.assert_close(db, dy.sum(0), rtol=1e-5, atol=1e-5)
    out, (dx, db, dres) = run(fused_dropout(1.0), leaves(x, b, res), dy)
    torch.testing.assert_close(out, res, rtol=0, atol=0)
    torch.testing.assert_close(dx, torch.zeros_like(dx), rtol=0, atol=0)
    no_bias = bias_dropout_add(x, None, res, 0.3, True, SEED, backend="triton")
    torch.testing.assert_close(no_bias, res + x * kernel_mask(x.shape, 0.3) / 0.7)


def test_dropout_saves_no_mask():
    x = torch.randn(33, 1000, device=DEVICE, requires_grad=True)
    saved = saved_for_backward(
        lambda: bias_dropout_add(x, None, torch.zeros_like(x), 0.5, True, backend="triton")
    )
    assert [t.numel() for t in saved] == [1]  # the seed


def _dropout_masks_on_tp_ranks(seed):
    os.environ["TRITON_INTERPRET"] = "1"  # this rank imports triton after this line
    state = parallel_state.initialize(2)
    state.seed(seed)
    x = torch.ones(7, 127)
    with state.rng.fork():
        sharded = bias_dropout_add(x, None, torch.zeros_like(x), 0.5, True, backend="triton")
    replicated = bias_dropout_add(x, None, torch.zeros_like(x), 0.5, True, backend="triton")
    return portable((sharded != 0, replicated != 0))


def portable(tensors):
    """Tensors as numpy arrays (bf16 widened to fp32, exactly): a rank's tensors sent back
    as tensors travel as shared-memory handles that die with the rank process."""
    if isinstance(tensors, torch.Tensor):
        t = tensors.detach()
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return type(tensors)(portable(t) for t in tensors)


def test_dropout_masks_follow_the_tp_rng_region():
    """Inside rng.fork() (TP-sharded region) masks differ across TP ranks; outside they match."""
    (sharded0, replicated0), (sharded1, replicated1) = run_ranks(
        _dropout_masks_on_tp_ranks, 2, 5, env=INTERPRETER
    )
    assert (sharded0 != sharded1).any()
    assert (replicated0 == replicated1).all()


# ---------------------------------------------------------------- vocab-parallel cross-entropy


def ce_inputs(seed, tokens, vocab, dtype, vocab_size=None):
    """Logits [tokens, vocab] (the gathered, padded vocabulary), targets with some ignored
    (-100), and per-token grad_output weights; deterministic in ``seed`` on every process."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab_size or vocab, (tokens,), generator=gen)
    target[::5] = -100
    weights = torch.rand(tokens, generator=gen).to(dtype).float()  # representable in dtype
    return logits, target, weights


def ce_with_grad(fn, logits, target, weights):
    """(per-token loss, d <loss, weights> / d logits) of ``fn(logits, target)``."""
    (leaf,) = leaves(logits)
    loss = fn(leaf, target)
    (grad,) = torch.autograd.grad(loss, leaf, weights.to(loss.dtype))
    return loss.detach(), grad


def torch_ce(vocab_size, smoothing):
    """F.cross_entropy on the unpadded vocabulary: the independent reference."""
    return lambda logits, target: F.cross_entropy(
        logits[..., :vocab_size].transpose(1, -1) if logits.dim() > 2 else logits[:, :vocab_size],
        target,
        reduction="none",
        label_smoothing=smoothing,
    )


def layers_ce(vocab_size, smoothing):
    """layers.vocab_parallel_cross_entropy: the torch implementation with the same API."""
    return lambda logits, target: vocab_parallel_cross_entropy(
        logits, target, label_smoothing=smoothing, vocab_size=vocab_size
    )


def fused_ce(vocab_size, smoothing, **kw):
    return lambda logits, target: fused_vocab_parallel_cross_entropy(
        logits, target, label_smoothing=smoothing, vocab_size=vocab_size, **kw
    )


CE_CASES = [  # (tokens, padded vocab, vocab_size, label smoothing, BLOCK_V override)
    (33, 1000, 997, 0.0, None),
    (7, 1000, 997, 0.1, 128),
    (7, 127, None, 0.1, None),
    (1, 4099, 4000, 0.0, 1024),
]


@pytest.mark.parametrize("tokens,vocab,vocab_size,smoothing,block", CE_CASES, ids=str)
def test_fused_cross_entropy_tp1(tokens, vocab, vocab_size, smoothing, block, monkeypatch):
    if block is not None:  # several vocabulary chunks per row: exercises the online max
        from layers.kernels import cross_entropy_triton

        monkeypatch.setattr(cross_entropy_triton, "MAX_BLOCK_V", block)
    logits, target, weights = ce_inputs(0, tokens, vocab, torch.float32, vocab_size)
    args = (logits.to(DEVICE), target.to(DEVICE), weights.to(DEVICE))
    loss, grad = ce_with_grad(fused_ce(vocab_size, smoothing, backend="triton"), *args)
    ref_loss, ref_grad = ce_with_grad(torch_ce(vocab_size, smoothing), *args)
    exact_loss, exact_grad = ce_with_grad(
        torch_ce(vocab_size, smoothing), args[0].double(), args[1], args[2].double()
    )
    check("cross_entropy loss", loss, ref_loss, exact_loss)
    check("cross_entropy dlogits", grad, ref_grad, exact_grad)
    same_api = ce_with_grad(layers_ce(vocab_size, smoothing), *args)
    torch.testing.assert_close((loss, grad), same_api, rtol=1e-5, atol=1e-5)


def test_fused_cross_entropy_bf16_and_3d():
    """bf16 logits [batch, seq, vocab]. The loss is fp32, computed in fp32 from exact bf16
    values, so it must match float64 on those values to fp32 accuracy (1e-5); the gradient
    is rounded once to bf16 and follows the low-precision rule of the module docstring."""
    logits, target, weights = ce_inputs(1, 33, 1000, torch.bfloat16, 990)
    logits, target, weights = (
        t.view(3, 11, *t.shape[1:]).to(DEVICE) for t in (logits, target, weights)
    )
    loss, grad = ce_with_grad(fused_ce(990, 0.1, backend="triton"), logits, target, weights)
    ref_loss, ref_grad = ce_with_grad(torch_ce(990, 0.1), logits, target, weights)
    exact_loss, exact_grad = ce_with_grad(torch_ce(990, 0.1), logits.double(), target, weights)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, exact_loss.float(), rtol=1e-5, atol=1e-5)
    MAX_ERR["cross_entropy loss bfloat16"] = (
        (loss.double() - exact_loss).abs().max().item(),
        (ref_loss.double() - exact_loss).abs().max().item(),
    )
    check("cross_entropy dlogits", grad, ref_grad, exact_grad)


def test_fused_cross_entropy_overwrites_logits_only_when_grad_is_needed():
    logits, target, _ = (t.to(DEVICE) for t in ce_inputs(2, 7, 127, torch.float32))
    kept = logits.clone()
    with torch.no_grad():
        fused_vocab_parallel_cross_entropy(logits, target, backend="triton")
    torch.testing.assert_close(logits, kept, rtol=0, atol=0)  # no gradient: left intact

    hidden = torch.randn(7, 16, device=DEVICE, requires_grad=True)
    head = torch.randn(16, 127, device=DEVICE, requires_grad=True)
    loss = fused_vocab_parallel_cross_entropy(hidden @ head, target, backend="triton")
    loss.sum().backward()  # flows through the in-place gradient into the LM head
    ref_hidden, ref_head = leaves(hidden, head)
    F.cross_entropy(ref_hidden @ ref_head, target, reduction="sum").backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.grad, ref_head.grad, rtol=1e-5, atol=1e-5)

    (leaf,) = leaves(logits)
    other_use = leaf.sin()  # saves leaf for its backward
    loss = fused_vocab_parallel_cross_entropy(leaf, target, backend="triton")
    assert not torch.equal(leaf.detach(), kept)  # overwritten by the gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss.sum() + other_use.sum()).backward()


def lm_head_inputs(seed, tokens=13, hidden=16, vocab=128):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 3
    target = torch.randint(0, 120, (tokens,), generator=gen)
    target[::4] = -100
    return h, w, target


def lm_head_reference(h, w, target, reduction, smoothing=0.1, vocab_size=120):
    """float64 F.cross_entropy of h @ w^T over the first vocab_size columns, and its grads."""
    h, w = leaves(h.double(), w.double())
    logits = (h @ w.t())[:, :vocab_size]
    loss = F.cross_entropy(logits, target, reduction=reduction, label_smoothing=smoothing)
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fused_linear_cross_entropy_tp1(reduction):
    """Chunks of 5 over 13 tokens (a ragged last chunk) against float64 F.cross_entropy of
    the full logits; fp32 tolerance 1e-5 as for the other kernels."""
    h, w, target = (t.to(DEVICE) for t in lm_head_inputs(0))
    hl, wl = leaves(h, w)
    loss = fused_linear_cross_entropy(
        hl,
        wl,
        target,
        label_smoothing=0.1,
        vocab_size=120,
        reduction=reduction,
        chunk_tokens=5,
        backend="triton",
    )
    loss.backward()
    ref = lm_head_reference(h, w, target, reduction)
    results = (loss, hl.grad, wl.grad)
    for name, got, exact in zip(("loss", "dhidden", "dweight"), results, ref, strict=True):
        torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(
        fused_linear_cross_entropy(
            h, w, target, label_smoothing=0.1, vocab_size=120, reduction=reduction, backend="torch"
        ),
        loss.detach(),
        rtol=1e-5,
        atol=1e-5,
    )


TP2_CE_CASES = [  # (seed, tokens, vocab per rank, vocab_size, smoothing, dtype)
    (3, 33, 500, 990, 0.1, torch.float32),
    (4, 7, 64, 40, 0.0, torch.float32),  # rank 1 holds only padding
    (5, 33, 500, None, 0.0, torch.bfloat16),
]


def _cross_entropy_on_tp_ranks(cases):
    os.environ["TRITON_INTERPRET"] = "1"  # this rank imports triton after this line
    state = parallel_state.initialize(2)
    results = []
    for seed, tokens, local, vocab_size, smoothing, dtype in cases:
        logits, target, weights = ce_inputs(seed, tokens, 2 * local, dtype, vocab_size)
        mine = logits[:, state.tp_rank * local : (state.tp_rank + 1) * local]
        fused = ce_with_grad(
            fused_ce(vocab_size, smoothing, backend="triton"), mine, target, weights
        )
        ref = ce_with_grad(layers_ce(vocab_size, smoothing), mine, target, weights)
        results.append(portable((fused, ref)))
    # The chunked LM head: hidden replicated (through copy_to_tp), weight split by rows.
    h, w, target = lm_head_inputs(6)
    (hl,) = leaves(h)
    (wl,) = leaves(w[state.tp_rank * 64 : (state.tp_rank + 1) * 64])
    loss = fused_linear_cross_entropy(
        copy_to_tp(hl),
        wl,
        target,
        label_smoothing=0.1,
        vocab_size=120,
        chunk_tokens=5,
        backend="triton",
    )
    loss.backward()
    return results, portable((loss.detach(), hl.grad, wl.grad))


def to_torch(arrays, dtype):
    """Undo ``portable`` for a (loss, grad) nesting: losses are fp32, gradients ``dtype``."""
    (loss, grad), (ref_loss, ref_grad) = ([torch.from_numpy(a) for a in pair] for pair in arrays)
    return (loss, grad.to(dtype)), (ref_loss, ref_grad.to(dtype))


def test_fused_cross_entropy_tp2():
    """Two gloo ranks, each with half the vocabulary, against F.cross_entropy on the gathered
    logits (and layers.vocab_parallel_cross_entropy on the same shards); and the chunked LM
    head with its weight split by vocabulary rows against float64 on the full weight."""
    per_rank, lm_head = zip(
        *run_ranks(_cross_entropy_on_tp_ranks, 2, TP2_CE_CASES, env=INTERPRETER), strict=True
    )
    exact_loss, exact_dh, exact_dw = (
        t.float() for t in lm_head_reference(*lm_head_inputs(6), "mean")
    )
    for rank, (loss, dh, dw) in enumerate(lm_head):
        torch.testing.assert_close(torch.from_numpy(loss), exact_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(dh), exact_dh, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            torch.from_numpy(dw), exact_dw[rank * 64 : (rank + 1) * 64], rtol=1e-5, atol=1e-5
        )
    for i, (seed, tokens, local, vocab_size, smoothing, dtype) in enumerate(TP2_CE_CASES):
        (loss0, grad0), ref0 = to_torch(per_rank[0][i], dtype)
        (loss1, grad1), _ = to_torch(per_rank[1][i], dtype)
        torch.testing.assert_close(loss0, loss1, rtol=0, atol=0)  # every rank has the loss
        grad = torch.cat([grad0, grad1], dim=-1)
        logits, target, weights = ce_inputs(seed, tokens, 2 * local, dtype, vocab_size)
        ref_loss, ref_grad = ce_with_grad(torch_ce(vocab_size, smoothing), logits, target, weights)
        exact = ce_with_grad(torch_ce(vocab_size, smoothing), logits.double(), target, weights)
        if dtype == torch.float32:
            check("cross_entropy tp2 loss", loss0, ref_loss, exact[0])
        else:  # fp32 loss from bf16 logits: see test_fused_cross_entropy_bf16_and_3d
            torch.testing.assert_close(loss0, exact[0].float(), rtol=1e-5, atol=1e-5)
        check("cross_entropy tp2 dlogits", grad, ref_grad, exact[1])
        torch.testing.assert_close(loss0, ref0[0], rtol=1e-5, atol=1e-5)
        # In bf16 the fused gradient is rounded twice (written in forward, scaled in
        # backward), the torch version's once: up to one bf16 ulp (2^-7 relative) each.
        tol = 1e-5 if dtype == torch.float32 else 2**-6
        torch.testing.assert_close(grad0, ref0[1], rtol=tol, atol=tol)


def test_strided_inputs():
    """Column slices (row stride != width) and transposed inputs give the same results."""
    big = torch.randn(33, 300, device=DEVICE)
    x = big[:, 7:134]  # [33, 127], row stride 300
    xt = torch.randn(127, 5, device=DEVICE).t()  # [5, 127], column stride 5
    b, res = torch.randn(127, device=DEVICE), torch.randn(33, 127, device=DEVICE)
    for inp in (x, xt):
        torch.testing.assert_close(
            layer_norm(inp, b, b, backend="triton"),
            F.layer_norm(inp, (127,), b, b),
            rtol=1e-5,
            atol=1e-5,
        )
        torch.testing.assert_close(
            bias_gelu(inp, b, backend="triton"), F.gelu(inp + b, approximate="tanh")
        )
    torch.testing.assert_close(
        bias_dropout_add(x, b, res, 0.0, True, backend="triton"), res + (x + b), rtol=0, atol=0
    )
    logits = big[:, :250]
    target = torch.randint(0, 250, (33,), device=DEVICE)
    torch.testing.assert_close(
        fused_vocab_parallel_cross_entropy(logits, target, backend="triton"),
        F.cross_entropy(logits, target, reduction="none"),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "op", ["layer_norm", "rms_norm", "bias_gelu", "bias_dropout_add", "swiglu"]
)
def test_empty_inputs_give_torchs_empty_outputs_and_zero_parameter_gradients(op):
    """A batch with no rows (an MoE expert that got no tokens, an empty shard) runs, as
    torch's ops do: empty outputs and input gradients, and weight and bias gradients of
    zeros (each kernel's row groups once divided by zero here)."""
    w, b = (torch.randn(8, device=DEVICE, requires_grad=True) for _ in range(2))
    x, res = (torch.randn(2, 0, 8, device=DEVICE, requires_grad=True) for _ in range(2))
    gate_up = torch.randn(2, 0, 16, device=DEVICE, requires_grad=True)
    calls = {
        "layer_norm": lambda k: k.layer_norm(x, w, b, backend=k.backend),
        "rms_norm": lambda k: k.rms_norm(x, w, 1e-6, backend=k.backend),
        "bias_gelu": lambda k: k.bias_gelu(x, b, backend=k.backend),
        "bias_dropout_add": lambda k: k.bias_dropout_add(x, b, res, 0.1, True, backend=k.backend),
        "swiglu": lambda k: k.swiglu(gate_up, backend=k.backend),
    }
    results = []
    for backend in ("triton", "torch"):
        out = calls[op](SimpleNamespace(**vars(kernels), backend=backend))
        leaves = (x, res, gate_up, w, b)  # those the op does not use get None
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    assert out.shape == ref.shape and out.dtype == ref.dtype
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # empty, or exact zeros


def test_a_zero_width_row_is_refused_in_one_line():
    """No model has rows of width 0 (torch's ops return empty tensors for them): each
    Triton path refuses them with a ValueError naming the shape, not a reshape error."""
    x, v = torch.randn(3, 0, device=DEVICE), torch.randn(0, device=DEVICE)
    calls = {
        "layer_norm": lambda: layer_norm(x, v, v, backend="triton"),
        "rms_norm": lambda: kernels.rms_norm(x, v, backend="triton"),
        "bias_gelu": lambda: bias_gelu(x, v, backend="triton"),
        "bias_dropout_add": lambda: bias_dropout_add(x, v, x, 0.1, True, backend="triton"),
        "swiglu": lambda: kernels.swiglu(x, backend="triton"),
        "cross_entropy": lambda: fused_vocab_parallel_cross_entropy(
            x, torch.zeros(3, dtype=torch.long, device=DEVICE), backend="triton"
        ),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=r"\(3, 0\)"):
            call()


# ---------------------------------------------------------------- dispatch


def test_backend_selection(monkeypatch):
    x = torch.randn(3, 8, device=DEVICE)
    w, b = torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    ref = F.layer_norm(x, (8,), w, b)
    torch.testing.assert_close(layer_norm(x, w, b, backend="torch"), ref, rtol=0, atol=0)
    x64 = x.double()  # no kernel for fp64: "auto" falls back to torch, "triton" refuses
    torch.testing.assert_close(
        layer_norm(x64, w.double(), b.double()), F.layer_norm(x64, (8,), w.double(), b.double())
    )
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        layer_norm(x64, w.double(), b.double(), backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        layer_norm(x, w, b, backend="cuda")
    with pytest.raises(ValueError, match="only available for layer_norm"):
        bias_gelu(x, b, backend="apex")
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        layer_norm(x, torch.ones(7, device=DEVICE), b, backend="triton")
    try:
        import apex  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="apex"):
            layer_norm(x, w, b, backend="apex")
    # CPU tensors without the interpreter: "auto" takes torch, "triton" says how to fix it.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b, ref = x.cpu(), w.cpu(), b.cpu(), ref.cpu()
    assert not use_triton(x, "auto")
    torch.testing.assert_close(layer_norm(x, w, b), ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(x, "triton")


def test_one_auto_rule_for_ops_and_the_model_kernel_set():
    """``backend="auto"`` and ``model.kernels=auto`` follow one rule: the fused kernel only
    where ``MODEL_AUTO`` says so for the tensor's last dimension (checked just below and
    at the threshold) and the tensor is on CUDA; never the interpreter, even
    when it is on (as in this module on CPU). Seen from outside: the model's fused
    cross-entropy overwrites its logits with the gradient, torch's leaves them intact."""
    from layers.kernel_set import resolve_kernels
    from layers.kernels.dispatch import MODEL_AUTO, choose_backend

    for op, smallest in MODEL_AUTO.items():
        for width in sorted({8, max(1, (smallest or 8) - 1), smallest or 8}):
            x = torch.empty(2, width, device=DEVICE)
            fused = smallest is not None and width >= smallest and DEVICE.type == "cuda"
            assert choose_backend(op, x, "auto") == ("triton" if fused else "torch"), (op, width)
        assert choose_backend(op, x, "triton") == "triton", op
        assert choose_backend(op, x, "torch") == "torch", op
    logits, target, _ = (t.to(DEVICE) for t in ce_inputs(7, 5, 64, torch.float32))
    for name, overwrites in (
        ("auto", MODEL_AUTO["cross_entropy"] == 0 and DEVICE.type == "cuda"),
        ("triton", True),
        ("torch", False),
    ):
        (leaf,) = leaves(logits)
        loss = resolve_kernels(name).cross_entropy(leaf, target)
        # fp32 as for the other kernels (1e-5): the same sums, in another order.
        torch.testing.assert_close(
            loss, F.cross_entropy(logits, target, reduction="none"), rtol=1e-5, atol=1e-5
        )
        assert (not torch.equal(leaf.detach(), logits)) is overwrites, name


@pytest.mark.slow
def test_bench_kernels_smoke(tmp_path, monkeypatch):
    """tools/bench_kernels.py --smoke: runs every kernel, checks it against torch, writes files."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "bench_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    rows = bench.main(["--smoke", "--no-compile", "--reps", "1", "--out", str(tmp_path)])
    assert {r["op"] for r in rows} == {
        "layer_norm",
        "bias_gelu",
        "bias_dropout_add",
        "cross_entropy",
        "rms_norm",
        "swiglu",
    }
    assert all(r["max_err_vs_torch"] <= 1e-4 for r in rows)
    for name in ("kernels.csv", "kernels.md", "kernels.png"):
        assert (tmp_path / name).stat().st_size > 0
    if DEVICE.type == "cpu":
        assert "not measured" in (tmp_path / "kernels.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_big_shapes_on_gpu(dtype):
    for m, n in ((4096, 8192), (2048, 12288)):
        x = torch.randn(m, n, device="cuda").to(dtype)
        w, b = torch.randn(n, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype)
        dy = torch.randn(m, n, device="cuda").to(dtype)
        compare(
            "layer_norm (gpu)",
            lambda x, w, b: layer_norm(x, w, b, backend="triton"),
            lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
            (x, w, b),
            dy,
            ("x", "weight", "bias"),
        )
        compare(
            "bias_gelu (gpu)",
            lambda x, b: bias_gelu(x, b, backend="triton"),
            lambda x, b: F.gelu(x + b, approximate="tanh"),
            (x, b),
            dy,
            ("x", "bias"),
        )


def test_fused_linear_cross_entropy_under_autocast():
    """bf16 autocast (the default on CUDA) must run and stay as accurate as torch's own
    autocast path: kernel error vs fp32 ≤ 2 × torch-autocast error vs fp32 + 1e-3 (the
    bf16 logits carry ~2⁻⁸ relative error either way; the floor covers a near-zero case)."""
    from layers.fused_cross_entropy import fused_linear_cross_entropy

    torch.manual_seed(0)
    h, w = torch.randn(12, 32, device=DEVICE), torch.randn(50, 32, device=DEVICE) * 0.2
    t = torch.randint(0, 50, (12,), device=DEVICE)

    def grads(fn, autocast):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(hh, ww)
        loss.float().backward()
        return loss.float().detach(), hh.grad, ww.grad

    torch_fn = lambda hh, ww: F.cross_entropy(hh @ ww.t(), t)
    exact = grads(torch_fn, False)
    lowp = grads(torch_fn, True)
    fused = grads(lambda hh, ww: fused_linear_cross_entropy(hh, ww, t, backend="triton"), True)
    assert fused[1].dtype == torch.float32 and fused[2].dtype == torch.float32
    for got, ref, want in zip(fused, lowp, exact, strict=True):
        torch_err = (ref - want).abs().max().item()
        assert (got - want).abs().max().item() <= 2 * torch_err + 1e-3
