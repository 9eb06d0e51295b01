"""studies.bench.step_profile: a step's profiled time summed by kind of work adds up to
torch's own profiler total, and real kernel names land in the kind they are."""

import re
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from studies.bench import step_profile
from studies.bench.step_profile import kind_of, kind_times

# Kernel names as torch's profiler reports them on H100/H200 machines (cuBLAS, flash and
# memory-efficient attention, cuDNN attention, inductor, foreach/fused AdamW, NCCL) and
# aten op names off CUDA, each with the kind it is.
NAMES = {
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn>(": "matmul",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(": "matmul",
    "aten::addmm": "matmul",
    "aten::mm": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>(": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel": (
        "attention"
    ),
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "triton_per_fused__to_copy_add_native_layer_norm_0": "compiled",
    "triton_red_fused__log_softmax_backward_data_nll_loss_backward_3": "compiled",
    "_layer_norm_bwd_kernel": "fused kernels",
    "_cross_entropy_fwd_stats_kernel": "fused kernels",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>(": (
        "optimizer"
    ),
    "aten::_fused_adamw_": "optimizer",
    "aten::_foreach_mul_": "optimizer",
    "Memcpy DtoD (Device -> Device)": "copies",
    "Memset (Device)": "copies",
    "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda(": "copies",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 2>(": (
        "copies"
    ),
    "aten::copy_": "copies",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void at::native::embedding_backward_feature_kernel<float, float, long>(": "other",
    "aten::gelu": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_a_kernel_name_lands_in_its_kind(name):
    assert kind_of(name) == NAMES[name]


def _step(model, optimizer, x):
    q = model(x).view(4, 2, 16, 8).transpose(1, 2)  # [batch, heads, seq, head dim]
    y = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    y.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _total_ms(table: str, label: str) -> float:
    """A total line of torch's profiler table (``Self CPU time total: 1.234ms``), in ms."""
    value, unit = re.search(rf"{label}: ([\d.]+)(us|ms|s)\b", table).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def test_the_kinds_add_up_to_the_profilers_own_total():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(4, 16, 16, device="cpu")
    _step(model, optimizer, x)  # the optimizer's state exists before profiling
    steps = 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(model, optimizer, x)
    averages = prof.key_averages()
    clock, times = kind_times(averages, steps)
    assert clock == "cpu"
    # torch prints its total with 3 decimals in the unit it picks: compare to that rounding.
    expected = _total_ms(averages.table(row_limit=1), "Self CPU time total") / steps
    assert times["total"] == pytest.approx(expected, rel=1e-3, abs=1e-3)
    assert times["total"] == pytest.approx(sum(v for k, v in times.items() if k != "total"))
    mm = sum(e.self_cpu_time_total for e in averages if e.key in ("aten::mm", "aten::addmm"))
    assert mm > 0 and times["matmul"] >= mm / 1e3 / steps * (1 - 1e-9)
    assert {"attention", "optimizer"} <= set(times)


def _event(key, device, us, annotation=False):
    device_type = DeviceType.CUDA if device else DeviceType.CPU
    return SimpleNamespace(
        key=key,
        device_type=device_type,
        self_device_time_total=us if device else 0.0,
        self_cpu_time_total=0.0 if device else us,
        is_user_annotation=annotation,
    )


def test_device_events_are_the_clock_when_there_are_any():
    # As torch's table totals a CUDA profile: the device events' self time, without the
    # CPU ops that launched them and without user annotations (both would count twice).
    events = [
        _event("aten::mm", False, 900.0),
        _event("nvjet_tst_128x256", True, 4000.0),
        _event("triton_poi_fused_add_0", True, 1000.0),
        _event("## forward ##", True, 7000.0, annotation=True),
        _event("Memset (Device)", True, 200.0),
    ]
    clock, times = kind_times(events, steps=2)
    assert clock == "gpu"
    assert times == {"matmul": 2.0, "compiled": 0.5, "copies": 0.1, "total": 2.6}


def test_the_lines_give_each_kind_and_the_differences_largest_first():
    ours = {"matmul": 100.0, "compiled": 12.0, "optimizer": 5.0, "other": 0.52, "total": 117.52}
    theirs = {"matmul": 100.5, "compiled": 6.0, "copies": 1.0, "other": 0.5, "total": 108.0}
    assert step_profile.kinds_line(ours) == (
        "matmul 100.0 · compiled 12.0 · optimizer 5.0 · other 0.5 (total 117.5) ms"
    )
    # other's +0.02 ms is under the 0.05 ms shown: left out
    assert step_profile.difference_line(ours, theirs) == (
        "compiled +6.0, optimizer +5.0, copies -1.0, matmul -0.5, total +9.5 ms"
    )
