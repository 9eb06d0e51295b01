"""The Llama family's fused kernels (RMSNorm, SwiGLU) against float64 references written here,
forward and every gradient, and inside a whole tiny Llama against ``kernels=torch``.

Kernels run on ``DEVICE``: compiled on CUDA tensors when CUDA is present, else in the Triton
interpreter on CPU tensors, for which this module sets ``TRITON_INTERPRET=1`` before
anything imports triton (as tests/test_kernels.py does; the TP=2 ranks get it in their
environment). The references are plain torch expressions evaluated in float64 on the same
(already rounded) inputs, not the code under test.

Tolerances, ``assert_close(kernel, float64 reference, rtol, atol)``:
- fp32: rtol 1e-5, atol 1e-5 · max(1, max|ref|): fp32 accumulation over <= 1500 terms
  stays well inside 1e-5 relative (a few fp32 ulps of the terms); the absolute part follows the tensor's largest value because an
  element cancelled to near zero (dx, the silu derivative's zero) keeps the rounding error
  of the terms it was formed from.
- bf16: rtol 2⁻⁷, atol 1e-5 · max(1, max|ref|): the kernel computes in fp32 and rounds
  once to bf16, within one bf16 ulp (2⁻⁷ relative; a whole ulp, not half, because triton
  3.9's interpreter converts fp32 to bf16 by truncation); atol again covers the fp32
  error of cancelled elements.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; see the module docstring

import pytest  # noqa: E402

import parallel_state  # noqa: E402
from engine.models import build_model  # noqa: E402
from engine.models.config import preset  # noqa: E402
from layers.kernel_set import TORCH_KERNELS, resolve_kernels  # noqa: E402
from layers.kernels import RMSNorm, rms_norm, swiglu  # noqa: E402
from layers.kernels.dispatch import MODEL_AUTO, choose_backend  # noqa: E402
from tests.kernel_util import print_max_errors, saved_for_backward  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402
from tests.tiny_configs import tiny_kwargs  # noqa: E402
from tests.torch_reference import relative_errors  # noqa: E402

# tl.sigmoid of a very negative gate overflows exp to inf in the interpreter's numpy and
# correctly gives 0; numpy warns about the inf.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETER = {"TRITON_INTERPRET": "1"}
# (rtol, atol relative to max(1, max|ref|)) per dtype; reasons in the module docstring.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-5)}
ROWS = (1, 7, 31)  # one row; fewer rows than the interpreter's 4 backward programs; a prime
WIDTHS = (1, 17, 100, 257, 1500)  # 1500: SwiGLU's f spans two 1024-wide column tiles
CASES = [(m, n, d) for m in ROWS for n in WIDTHS for d in TOLERANCES]
EPS = 1e-6
# Worst |kernel - float64 reference| per op, tensor and dtype (printed at the end, with -s).
MAX_ERR: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_max_errors():
    yield
    print_max_errors("max |kernel - float64 reference|", MAX_ERR, width=28)


def check(name: str, got: torch.Tensor, ref64: torch.Tensor) -> None:
    """``got`` (a kernel output or gradient) against its float64 reference."""
    got, ref64 = got.detach(), ref64.detach()
    rtol, atol = TOLERANCES[got.dtype]
    scale = max(1.0, ref64.abs().max().item()) if ref64.numel() else 1.0
    err = (got.double() - ref64).abs().max().item() if got.numel() else 0.0
    key = f"{name} {str(got.dtype).removeprefix('torch.')}"
    MAX_ERR[key] = max(MAX_ERR.get(key, 0.0), err)
    torch.testing.assert_close(
        got.double(), ref64, rtol=rtol, atol=atol * scale, msg=lambda m: f"{name}: {m}"
    )


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · w, in x's dtype (float64 here)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, silu written out: gate · sigmoid(gate)."""
    return gate * torch.sigmoid(gate) * up


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., f] gate and up → [..., 2f] with gate at even and up at odd columns."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


# ---------------------------------------------------------------- RMSNorm


def _rms_norm_case(x: torch.Tensor, w: torch.Tensor, dy_scale: float = 1.0) -> None:
    xk, wk = leaf(x), leaf(w)
    y = rms_norm(xk, wk, EPS, backend="triton")
    dy = (torch.randn(y.shape, device=DEVICE) * dy_scale).to(y.dtype)
    y.backward(dy)
    x64, w64 = leaf(x.double()), leaf(w.double())
    y64 = rms_norm_reference(x64, w64)
    y64.backward(dy.double())
    assert y.dtype == torch.promote_types(x.dtype, w.dtype)
    assert xk.grad.dtype == x.dtype and wk.grad.dtype == w.dtype
    check("rms_norm out", y, y64)
    check("rms_norm dx", xk.grad, x64.grad)
    check("rms_norm dw", wk.grad, w64.grad)


@pytest.mark.parametrize("m,n,dtype", CASES, ids=str)
def test_rms_norm(m, n, dtype):
    x = torch.randn(m, n, device=DEVICE).mul(3).add(0.5).to(dtype)  # rms far from 1
    w = torch.randn(n, device=DEVICE).to(dtype)
    _rms_norm_case(x, w)


def test_rms_norm_3d_strided_and_mixed_dtypes():
    """Leading dims, a row stride wider than the row, and fp32 weights with bf16 x (the
    output then fp32, as torch's ``weight * normed`` promotes)."""
    _rms_norm_case(torch.randn(2, 3, 100, device=DEVICE), torch.randn(100, device=DEVICE))
    wide = torch.randn(7, 300, device=DEVICE)
    _rms_norm_case(wide[:, 11:128], torch.randn(117, device=DEVICE))
    x = torch.randn(7, 100, device=DEVICE).to(torch.bfloat16)
    xk, wk = leaf(x), leaf(torch.randn(100, device=DEVICE))
    y = rms_norm(xk, wk, EPS, backend="triton")
    y.sum().backward()
    assert y.dtype == wk.grad.dtype == torch.float32 and xk.grad.dtype == torch.bfloat16
    x64, w64 = leaf(x.double()), leaf(wk.detach().double())
    y64 = rms_norm_reference(x64, w64)
    y64.sum().backward()
    check("rms_norm out", y, y64)
    check("rms_norm dx", xk.grad, x64.grad)
    check("rms_norm dw", wk.grad, w64.grad)


def test_rms_norm_without_weight_and_module():
    x = torch.randn(7, 33, device=DEVICE)
    torch.testing.assert_close(
        rms_norm(x, None, EPS, backend="triton"),
        rms_norm_reference(x.double(), 1.0).float(),
        rtol=1e-5,
        atol=1e-5,
    )
    fused = RMSNorm(33, eps=EPS, device=DEVICE, backend="triton")
    assert set(fused.state_dict()) == {"weight"}
    with torch.no_grad():
        fused.weight.normal_()
    torch.testing.assert_close(
        fused(x), rms_norm(x, fused.weight, EPS, backend="torch"), rtol=1e-5, atol=1e-5
    )


def test_rms_norm_saves_input_weight_and_rstd_only():
    x = torch.randn(5, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    saved = saved_for_backward(lambda: rms_norm(x, w, backend="triton"))
    assert [tuple(t.shape) for t in saved] == [(5, 64), (64,), (5,)]
    assert saved[2].dtype == torch.float32


# ---------------------------------------------------------------- SwiGLU


def _swiglu_case(gate: torch.Tensor, up: torch.Tensor) -> None:
    gu = leaf(interleave(gate, up))
    y = swiglu(gu, backend="triton")
    dy = torch.randn(y.shape, device=DEVICE).to(y.dtype)
    y.backward(dy)
    g64, u64 = leaf(gate.double()), leaf(up.double())
    y64 = swiglu_reference(g64, u64)
    y64.backward(dy.double())
    assert y.dtype == gu.grad.dtype == gate.dtype
    check("swiglu out", y, y64)
    check("swiglu dgate", gu.grad[..., 0::2], g64.grad)
    check("swiglu dup", gu.grad[..., 1::2], u64.grad)


@pytest.mark.parametrize("m,f,dtype", CASES, ids=str)
def test_swiglu(m, f, dtype):
    # Gates over [-12, 12]: silu's saturated tails, its minimum near -1.28 and the
    # derivative's zero near -2.4 all occur.
    gate = (torch.randn(m, f, device=DEVICE) * 4).to(dtype)
    up = (torch.randn(m, f, device=DEVICE) * 2).to(dtype)
    _swiglu_case(gate, up)


def test_swiglu_3d_strided_bias_and_odd_width():
    _swiglu_case(torch.randn(2, 3, 17, device=DEVICE), torch.randn(2, 3, 17, device=DEVICE))
    # A row stride wider than the row (a column slice of a bigger tensor).
    wide = torch.randn(7, 300, device=DEVICE) * 3
    gu = leaf(wide[:, 20:220])
    y = swiglu(gu, backend="triton")
    y.sum().backward()
    g64 = leaf(wide[:, 20:220:2].double())
    u64 = leaf(wide[:, 21:220:2].double())
    swiglu_reference(g64, u64).sum().backward()
    check("swiglu out", y, swiglu_reference(g64, u64))
    check("swiglu dgate", gu.grad[:, 0::2], g64.grad)
    check("swiglu dup", gu.grad[:, 1::2], u64.grad)
    # A bias is added (by torch) before the kernel: its gradient is the input's.
    gu, b = leaf(torch.randn(7, 40, device=DEVICE)), leaf(torch.randn(40, device=DEVICE))
    y = swiglu(gu, b, backend="triton")
    y.sum().backward()
    torch.testing.assert_close(y, swiglu(gu + b, backend="torch"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, gu.grad.sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even, non-empty last dim"):
        swiglu(torch.randn(3, 7, device=DEVICE), backend="triton")


def test_swiglu_saves_only_its_input():
    gu = torch.randn(5, 64, device=DEVICE, requires_grad=True)
    saved = saved_for_backward(lambda: swiglu(gu, backend="triton"))
    assert [t.data_ptr() for t in saved] == [gu.data_ptr()]


# ---------------------------------------------------------------- dispatch


def test_auto_runs_the_llama_kernels_from_their_measured_widths():
    """Measured on a GPU at h 2048 and a gate/up width of 16384: ``auto`` runs them there on
    CUDA, and torch, bit for bit, below those widths or off CUDA; ``triton`` runs them."""
    assert MODEL_AUTO["rms_norm"] == 2048 and MODEL_AUTO["swiglu"] == 16384
    cuda = DEVICE.type == "cuda"
    for op, width in (("rms_norm", 2048), ("swiglu", 16384)):
        wide, narrow = (
            torch.randn(3, width, device=DEVICE),
            torch.randn(3, width // 2, device=DEVICE),
        )
        assert choose_backend(op, wide, "auto") == ("triton" if cuda else "torch")
        assert choose_backend(op, narrow, "auto") == "torch"
        assert choose_backend(op, narrow, "triton") == "triton"
    x, w = torch.randn(3, 1024, device=DEVICE), torch.randn(1024, device=DEVICE)
    gu = torch.randn(3, 8192, device=DEVICE)
    auto = resolve_kernels("auto")
    torch.testing.assert_close(
        auto.rms_norm(x, w, EPS), TORCH_KERNELS.rms_norm(x, w, EPS), rtol=0, atol=0
    )
    torch.testing.assert_close(
        auto.swiglu(gu, None), TORCH_KERNELS.swiglu(gu, None), rtol=0, atol=0
    )


# ---------------------------------------------------------------- a whole tiny Llama

# Relative (max |Δ| / max |ref| per tensor, and the loss) between kernels=triton and
# kernels=torch in fp32: both accumulate in fp32 but reduce in different orders (RMSNorm
# statistics, its weight gradient over rows), and each op's ~1e-6 error compounds through
# two layers, the LM head and the cross-entropy (the same bound as tiny GPT's).
MODEL_TOL = 2e-5
LAUNCHERS = ("rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward")


def _counting_launchers(monkeypatch) -> dict[str, int]:
    """Count calls of the four launchers: proof that the model ran the kernels."""
    from layers.kernels import rms_norm_triton, swiglu_triton

    calls = dict.fromkeys(LAUNCHERS, 0)
    for module in (rms_norm_triton, swiglu_triton):
        for name in LAUNCHERS:
            if hasattr(module, name):
                original = getattr(module, name)

                def counted(*args, _name=name, _original=original):
                    calls[_name] += 1
                    return _original(*args)

                monkeypatch.setattr(module, name, counted)
    return calls


def _llama_loss_and_grads(kernels: str, sequence_parallel: bool = False, device="cpu"):
    ps = parallel_state.get() if parallel_state.is_initialized() else None
    shape = tiny_kwargs(vocab_size=97, num_kv_heads=2, ffn_hidden_size=44)  # no dropout
    cfg = preset("llama_tiny", **shape, kernels=kernels, sequence_parallel=sequence_parallel)
    if ps is not None:
        ps.seed(5)
    else:
        torch.manual_seed(5)
    model = build_model(cfg, ps, device=device)
    with torch.no_grad():  # non-trivial norm weights, so a wrong dw or w-scaling shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiny_llama_same_loss_and_grads_with_triton_kernels(monkeypatch):
    reference = _llama_loss_and_grads("torch", device=DEVICE)
    calls = _counting_launchers(monkeypatch)
    errors = relative_errors(reference, _llama_loss_and_grads("triton", device=DEVICE))
    # 2 layers: 2 RMSNorms and 1 SwiGLU each, and the final RMSNorm.
    assert calls == {
        "rms_norm_forward": 5,
        "rms_norm_backward": 5,
        "swiglu_forward": 2,
        "swiglu_backward": 2,
    }
    norm_weights = [n for n in errors if "norm" in n]
    assert len(norm_weights) == 5, norm_weights
    worst = max(errors, key=errors.get)
    print(f"\ntiny Llama, triton vs torch: worst {worst} {errors[worst]:.2e}")
    assert 0 < errors[worst] <= MODEL_TOL, f"{worst}: {errors[worst]:.2e}"


def _both_on_tp2(sequence_parallel: bool) -> dict[str, float]:
    parallel_state.initialize(2)
    return relative_errors(
        _llama_loss_and_grads("torch", sequence_parallel),
        _llama_loss_and_grads("triton", sequence_parallel),
    )


@pytest.mark.slow
def test_tiny_llama_triton_kernels_at_tp2_with_sequence_parallelism():
    """TP=2 (gloo, CPU): SwiGLU on each rank's half of the interleaved gate/up columns,
    RMSNorm on sequence shards with its weight gradient summed over TP."""
    for errors in run_ranks(_both_on_tp2, 2, True, env=INTERPRETER):
        worst = max(errors, key=errors.get)
        assert 0 < errors[worst] <= MODEL_TOL, f"{worst}: {errors[worst]:.2e}"


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_big_shapes_on_gpu(dtype):
    """Compiled kernels at model sizes (Llama-3 8B's h 4096, f 14336)."""
    x = (torch.randn(4096, 4096, device="cuda") * 3).to(dtype)
    _rms_norm_case(x, torch.randn(4096, device="cuda").to(dtype))
    gate = (torch.randn(2048, 14336, device="cuda") * 4).to(dtype)
    _swiglu_case(gate, torch.randn(2048, 14336, device="cuda").to(dtype))
