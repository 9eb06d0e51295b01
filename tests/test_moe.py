"""The mixture-of-experts MLP (layers/moe.py, layers/router.py) at one rank.

Against transformers' own blocks on copied weights (Mixtral, Qwen2-MoE, Qwen3-MoE), and
against hand-derived answers for what they do not cover: capacity dropping, tie breaking,
the sigmoid router with its bias, the grouped GEMM against its per-expert loop.

Single process, CPU (chosen explicitly), torch's element-wise ops, no process group; tiny
random configs built here (no hub access). float64 unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import layers.moe
from engine.models import ModelConfig, build_model
from layers.moe import MoEMLP, grouped_mm, grouped_mm_fits, moe_losses, permute, unpermute
from layers.router import Routing, capacity, capacity_keep, pooled_load_balancing_loss
from layers.spec import spec_for
from studies.verification.moe_blocks import block_to_ours as _to_ours
from studies.verification.moe_blocks import copy_block_weights as _copy_weights
from tests.moe_util import EXPERTS, FFN, LLAMA, H
from tests.moe_util import moe_cfg as _cfg

DEVICE = torch.device("cpu")
F64 = torch.float64


def _moe(cfg: ModelConfig, dtype=F64) -> MoEMLP:
    return MoEMLP(cfg, tp_group=None, dtype=dtype, device=DEVICE)


def _randn(*shape, gen, dtype=F64, std=1.0) -> torch.Tensor:
    return std * torch.randn(*shape, generator=gen, dtype=dtype, device=DEVICE)


# Qwen2-MoE's keys past its widths: a shared expert of width 20, top-2 of 6 not renormalised.
QWEN2_MOE = dict(
    shared_expert_intermediate_size=20,
    num_experts=EXPERTS,
    num_experts_per_tok=2,
    norm_topk_prob=False,
)
# transformers' blocks and the ModelConfig that describes the same layer. Mixtral:
# softmax top-2 renormalised; Qwen2-MoE: top-2 not renormalised, a gated shared expert;
# Qwen3-MoE: top-3 of 6 renormalised.
HF_BLOCKS = {
    "mixtral": (
        MixtralSparseMoeBlock,
        lambda: MixtralConfig(
            hidden_size=H, intermediate_size=FFN, num_local_experts=EXPERTS, num_experts_per_tok=2
        ),
        dict(moe_top_k=2, moe_renormalize=True),
    ),
    "qwen2_moe": (
        Qwen2MoeSparseMoeBlock,
        lambda: Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=FFN, **QWEN2_MOE),
        dict(moe_top_k=2, moe_renormalize=False, moe_shared_ffn_hidden_size=20),
    ),
    "qwen3_moe": (
        Qwen3MoeSparseMoeBlock,
        lambda: Qwen3MoeConfig(
            hidden_size=H,
            moe_intermediate_size=FFN,
            num_experts=EXPERTS,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
        dict(moe_top_k=3, moe_renormalize=True),
    ),
}


def _hf_block(name: str, gen: torch.Generator):
    block_class, hf_config, overrides = HF_BLOCKS[name]
    config = hf_config()
    config._experts_implementation = "eager"  # transformers' own per-expert loop
    block = block_class(config).to(F64)
    with torch.no_grad():  # std 0.4: routing varies by token; outputs reach ~9
        for p in block.parameters():
            p.copy_(_randn(*p.shape, gen=gen, std=0.4))
    return block, _cfg(**overrides)


def _block_and_copy(name: str, seed: int):
    """transformers' block ``name`` with random weights, our layer of the same config with
    those weights copied in, and the generator (seeded ``seed``) to draw the inputs from."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    block, cfg = _hf_block(name, gen)
    moe = _moe(cfg)
    _copy_weights(moe, block)
    return gen, block, cfg, moe


@pytest.mark.parametrize("name", sorted(HF_BLOCKS))
def test_outputs_and_gradients_equal_transformers_blocks(name):
    gen, block, cfg, moe = _block_and_copy(name, seed=0)
    x = _randn(7, 3, H, gen=gen)  # ours [s, b, h]; transformers' [b, s, h]
    grad_out = _randn(7, 3, H, gen=gen)
    x_ours, x_hf = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    out, bias = moe(x_ours)
    ref = block(x_hf).transpose(0, 1)
    assert bias is None and out.shape == x.shape
    out.backward(grad_out)
    ref.backward(grad_out)
    # float64 with the router at fp32 as transformers' is (its softmax takes
    # dtype=torch.float): both round the same probabilities to fp32, so the two differ
    # only in the order of the sums (a per-expert loop with index_add against grouped rows
    # summed per token): measured ≤ 1e-15 on outputs, ≤ 1.5e-14 on gradients, values up
    # to ~9. A wrong weight, layout, choice or permutation moves them by O(0.1).
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(x_ours.grad, x_hf.grad.transpose(0, 1), rtol=0, atol=1e-12)
    hf_grads = _to_ours({n: p.grad for n, p in block.named_parameters()})
    for n, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[n], rtol=0, atol=1e-12, msg=n)
    assert out.abs().max() > 0.3  # not near zero: the tolerance above is meaningful


def test_an_off_by_one_inverse_permutation_is_caught(monkeypatch):
    def shifted(rows, order, weights):  # each row put back one slot late
        return unpermute(rows, (order + 1) % weights.numel(), weights)

    monkeypatch.setattr(layers.moe, "unpermute", shifted)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_outputs_and_gradients_equal_transformers_blocks("mixtral")


@pytest.mark.parametrize("name", sorted(HF_BLOCKS))
def test_router_logits_choices_and_aux_loss_equal_transformers(name):
    gen, block, cfg, moe = _block_and_copy(name, seed=1)
    tokens = _randn(40, H, gen=gen)
    routing = moe.router(tokens)
    hf_logits, hf_weights, hf_experts = block.gate(tokens)
    # The same F.linear on the same fp64 rows, and the same fp32 softmax and top-k: equal.
    torch.testing.assert_close(routing.logits, hf_logits, rtol=0, atol=0)
    assert torch.equal(routing.experts, hf_experts)
    torch.testing.assert_close(routing.weights.to(F64), hf_weights.to(F64), rtol=0, atol=0)
    # transformers' aux loss sums in fp32 from an fp64 softmax, ours from the fp32 one:
    # the same value up to fp32 rounding of the probabilities (~1e-7 relative).
    hf_aux = load_balancing_loss_func((hf_logits,), EXPERTS, cfg.moe_top_k)
    losses = moe.router.last_losses
    torch.testing.assert_close(losses.aux, hf_aux, rtol=2e-6, atol=0)
    assert losses.slots_per_expert.sum() == 40 * cfg.moe_top_k
    # Several layers: transformers pools f and P over the layers before multiplying.
    second = _randn(40, H, gen=gen)
    moe.router(second)
    pooled = pooled_load_balancing_loss([losses, moe.router.last_losses])
    hf_pooled = load_balancing_loss_func((hf_logits, block.gate(second)[0]), EXPERTS, cfg.moe_top_k)
    torch.testing.assert_close(pooled, hf_pooled, rtol=2e-6, atol=0)


def test_aux_and_z_losses_in_fp64_are_the_formulas_and_their_gradients_reach_the_router():
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    cfg = _cfg(moe_router_dtype="fp64", moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.05)
    moe = _moe(cfg)
    tokens = _randn(30, H, gen=gen)
    moe.router(tokens)
    losses = moe.router.last_losses
    logits = tokens @ moe.router.weight.T
    probs = logits.softmax(-1)
    chosen = F.one_hot(probs.topk(2).indices, EXPERTS).sum(1).to(F64)  # [T, E]
    aux = EXPERTS * (chosen.mean(0) * probs.mean(0)).sum()
    z = logits.logsumexp(-1).square().mean()
    # float64 throughout; only the order of the sums differs: ~1e-16 on O(1) values.
    torch.testing.assert_close(losses.aux, aux, rtol=0, atol=1e-14)
    torch.testing.assert_close(losses.z, z, rtol=0, atol=1e-14)
    torch.testing.assert_close(losses.loss, 0.3 * aux + 0.05 * z, rtol=0, atol=1e-14)
    (grad,) = torch.autograd.grad(losses.loss, moe.router.weight)
    (expected,) = torch.autograd.grad(0.3 * aux + 0.05 * z, moe.router.weight)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-14)
    assert grad.abs().max() > 1e-3


def test_ties_go_to_the_lower_expert_index():
    cfg = _cfg(moe_top_k=3, moe_router_dtype="fp64")
    moe = _moe(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()  # every logit 0: all six experts tie
        moe.router.weight[4, 0] = 1.0  # expert 4 wins where x₀ > 0
        moe.router.weight[1, 0] = moe.router.weight[3, 0] = 0.5  # 1 and 3 tie behind it
    tokens = torch.zeros(3, H, dtype=F64)
    tokens[1, 0], tokens[2, 0] = 1.0, -1.0
    experts = moe.router(tokens).experts.tolist()
    # Token 0: all equal → 0, 1, 2. Token 1: 4, then the tie 1 = 3 → 1 first, then 3.
    # Token 2: experts 0, 2 and 5 stay at 0 (1 and 3 at −0.5, 4 at −1) → 0, 2, 5.
    assert experts == [[0, 1, 2], [4, 1, 3], [0, 2, 5]]


def test_capacity_keeps_the_highest_scores_then_the_earlier_token():
    # k = 2, limit 1. Expert 0 has slots (t0, .5), (t1, .5), (t2, .4): the tie at .5 keeps
    # t0, the earlier token. Expert 1: (t0, .3), (t2, .6) keeps t2. Expert 2: (t1, .2).
    experts = torch.tensor([[0, 1], [0, 2], [1, 0]])
    scores = torch.tensor([[0.5, 0.3], [0.5, 0.2], [0.6, 0.4]])
    keep = capacity_keep(experts, scores, limit=1, num_experts=3)
    assert keep.tolist() == [[True, False], [False, True], [True, False]]
    assert capacity(tokens=6, top_k=1, num_experts=2, factor=1.0) == 3
    assert capacity(tokens=5, top_k=2, num_experts=4, factor=1.25) == 4  # ⌈3.125⌉


def test_capacity_dropping_in_the_layer_drops_the_stated_tokens():
    # E = 2, k = 1, 6 tokens, factor 1: C = 3. Logits (ln(p/(1−p)), 0) give expert 0 the
    # probabilities below; token 5 prefers expert 1. Expert 0 keeps .9 (t1), .7 (t3) and,
    # of the three tied at .6, the earliest (t0): t2 and t4 are dropped.
    cfg = _cfg(moe_num_experts=2, moe_top_k=1, moe_capacity_factor=1.0, moe_router_dtype="fp64")
    moe = _moe(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 1.0
    p = torch.tensor([0.6, 0.9, 0.6, 0.7, 0.6, 0.2], dtype=F64)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x = _randn(6, 1, H, gen=gen)
    x[:, 0, 0] = torch.log(p / (1 - p))
    out, _ = moe(x)
    dropped = [t for t in range(6) if out[t].abs().max() == 0]
    assert dropped == [2, 4]
    assert moe.router.last_losses.dropped == 2
    # The kept tokens get their expert's output times their weight (k = 1, renormalised: 1).
    fc1, fc2 = moe.experts.fc1, moe.experts.fc2
    for t, e in ((0, 0), (1, 0), (3, 0), (5, 1)):
        gate_up = x[t, 0] @ fc1[e]
        expected = (F.silu(gate_up[0::2]) * gate_up[1::2]) @ fc2[e]
        torch.testing.assert_close(out[t, 0], expected, rtol=0, atol=1e-14)


def test_sigmoid_router_with_bias_matches_the_direct_formula():
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    cfg = _cfg(moe_router="sigmoid", moe_top_k=2, moe_router_dtype="fp64", moe_bias_update_rate=0.1)
    moe = _moe(cfg)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.25, -0.1, 0.05])
    moe.router.expert_bias.copy_(bias)
    x = _randn(9, 2, H, gen=gen)
    out, _ = moe(x)
    tokens = x.reshape(-1, H)
    s = torch.sigmoid(tokens @ moe.router.weight.T)
    expected, moved = torch.zeros_like(tokens), 0
    for t in range(len(tokens)):
        biased = (s[t] + bias.to(F64)).tolist()
        chosen = sorted(range(EXPERTS), key=lambda e: (-biased[e], e))[:2]
        moved += chosen != sorted(range(EXPERTS), key=lambda e: (-s[t, e].item(), e))[:2]
        weights = s[t, chosen] / s[t, chosen].sum()  # the unbiased scores, renormalised
        for w, e in zip(weights, chosen, strict=True):
            gate_up = tokens[t] @ moe.experts.fc1[e]
            expected[t] += w * (F.silu(gate_up[0::2]) * gate_up[1::2]) @ moe.experts.fc2[e]
    assert moved > 0  # the bias changed some choices
    # float64; only the order of the sums differs (~1e-16 on O(1) values).
    torch.testing.assert_close(out.reshape(-1, H), expected, rtol=0, atol=1e-12)
    # The bias is a buffer: no gradient, not a parameter; update_bias moves it by
    # γ · sign(mean load − load).
    assert "router.expert_bias" in moe.state_dict()
    assert "router.expert_bias" not in dict(moe.named_parameters())
    load = moe.router.last_losses.slots_per_expert
    moe.router.update_bias()
    step = 0.1 * torch.sign(load.double().mean() - load.double()).float()
    torch.testing.assert_close(moe.router.expert_bias, bias + step, rtol=0, atol=0)
    with pytest.raises(ValueError, match="set model.moe_router=sigmoid"):
        _moe(_cfg()).router.update_bias(load)


def test_permute_groups_by_expert_in_token_order_and_unpermute_inverts_it():
    experts = torch.tensor([[2, 0], [0, 1], [2, 1]])
    routing = Routing(logits=None, experts=experts, weights=None, keep=None)
    tokens = torch.arange(3, dtype=F64).unsqueeze(1).expand(3, 4)  # row t holds t
    rows, order, counts = permute(tokens, routing, num_experts=4)
    assert counts.tolist() == [2, 2, 2, 0]
    assert order.tolist() == [1, 2, 3, 5, 0, 4]  # slots t·k + j, by expert, then by slot
    assert rows[:, 0].tolist() == [0, 1, 1, 2, 0, 2]
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]], dtype=F64)
    out = unpermute(rows, order, weights)
    torch.testing.assert_close(out, tokens * weights.sum(1, keepdim=True), rtol=0, atol=0)


def test_grouped_gemm_equals_the_per_expert_loop():
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    counts = torch.tensor([3, 0, 5, 1, 7])  # uneven, one expert without rows
    x = _randn(16, 16, gen=gen, dtype=torch.float32).requires_grad_()
    w = _randn(5, 16, 32, gen=gen, dtype=torch.float32).requires_grad_()
    grad_out = _randn(16, 32, gen=gen, dtype=torch.float32)
    assert grouped_mm_fits(x, w)
    assert not grouped_mm_fits(x.double(), w.double())  # fp64 takes the loop
    assert not grouped_mm_fits(x[:, :10], w[:, :10, :])  # rows of 40 bytes, not 16·n
    results = []
    for impl in ("grouped", "loop"):
        out = grouped_mm(x, w, counts, impl=impl)
        results.append((out, *torch.autograd.grad(out, (x, w), grad_out)))
    # fp32: the same products summed in a different order (~1e-6 on O(4) values).
    for grouped, loop in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    exact = torch.cat(
        [
            x[a:b].double() @ w[e].double()
            for e, (a, b) in enumerate(zip((0, 3, 3, 8, 9), (3, 3, 8, 9, 16), strict=True))
        ]
    )
    torch.testing.assert_close(results[0][0].double(), exact, rtol=1e-5, atol=1e-5)
    # Experts 2 and 3 alone (a slice along dim 0, as a rank holding them would) give the
    # same rows.
    part = grouped_mm(x[3:9], w[2:4], counts[2:4], impl="loop")
    torch.testing.assert_close(part, results[1][0][3:9], rtol=0, atol=0)


def test_the_router_computes_its_logits_in_fp32_under_bf16_autocast():
    """moe_router_dtype=fp32 under bf16 autocast (the trainer's bf16): the router's GEMM
    runs in fp32 forward and backward, as Megatron-Core's does, not in the bf16 autocast
    gives a matmul. The reference is the fp64 product of the same fp32 operands; fp32's
    own rounding over 16 or 32 terms of O(1) stays below 1e-6, bf16's (2^-8 per operand)
    does not."""
    cfg = _cfg(moe_router_dtype="fp32")
    router = _moe(cfg, dtype=torch.float32).router
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    tokens = _randn(32, cfg.hidden_size, gen=gen, dtype=torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits = router(tokens).logits
    exact = tokens.double() @ router.weight.detach().double().T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=1e-6, atol=1e-6)
    # Backward too: d(Σ logits)/dW has every row equal to Σ_t x_t (a sum of 32 values).
    logits.sum().backward()
    want = tokens.double().sum(0).expand(cfg.moe_num_experts, -1)
    torch.testing.assert_close(router.weight.grad.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_the_grouped_gemm_runs_in_its_dtype(monkeypatch, rows_dtype):
    """bf16 autocast over fp32 weights (the trainer's bf16 precision): the experts take the
    grouped GEMM in bf16, as autocast runs a plain matmul. Rows may come in fp32 (after an
    fp32 norm) or bf16 (after a bf16 projection)."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    counts = torch.tensor([3, 0, 5, 1, 7])
    x = _randn(16, 16, gen=gen, dtype=torch.float32).to(rows_dtype).requires_grad_()
    w = _randn(5, 16, 32, gen=gen, dtype=torch.float32).requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = grouped_mm(x, w, counts)
    assert calls == [1] and out.dtype == torch.bfloat16
    # The reference: each expert's rows times its weight, both rounded to bf16 as autocast
    # rounds a matmul's inputs, multiplied exactly (fp64); then the result rounded to bf16.
    # Tolerance: one bf16 ulp (2^-8 relative) of outputs of magnitude up to about 10.
    xb, wb = x.detach().bfloat16().double(), w.detach().bfloat16().double()
    bounds = ((0, 3), (3, 3), (3, 8), (8, 9), (9, 16))
    exact = torch.cat([xb[a:b] @ wb[e] for e, (a, b) in enumerate(bounds)])
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=2**-8)
    grad_x, grad_w = torch.autograd.grad(out.float().sum(), (x, w))
    assert grad_x.dtype == rows_dtype and grad_w.dtype == torch.float32  # autocast's casts
    ref_w = torch.stack([xb[a:b].sum(0)[:, None].expand(-1, 32) for a, b in bounds])
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=2**-7, atol=2**-7)


def test_the_layer_takes_the_grouped_gemm_in_fp32_and_agrees_with_the_loop():
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    cfg = _cfg(moe_ffn_hidden_size=8, moe_shared_ffn_hidden_size=8)
    moe = _moe(cfg, dtype=torch.float32)
    x = _randn(5, 4, H, gen=gen, dtype=torch.float32)
    results = []
    for impl in ("grouped", "loop"):
        moe.experts.impl = impl
        moe.zero_grad()
        out, _ = moe(x)
        out.square().sum().backward()
        results.append([out] + [p.grad.clone() for p in moe.parameters()])
    for grouped, loop in zip(*results, strict=True):  # fp32 sums in another order
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_validation_errors_are_one_line_and_name_the_value_and_the_fix():
    cases = {
        "moe_top_k": (
            dict(moe_top_k=7),
            "model.moe_top_k=7 must be in [1, model.moe_num_experts=6]",
        ),
        "router": (
            dict(moe_router="relu"),
            "model.moe_router='relu' is not one of ('softmax', 'sigmoid')",
        ),
        "capacity": (
            dict(moe_capacity_factor=0.0),
            "model.moe_capacity_factor=0.0 must be > 0 and finite (or null: dropless)",
        ),
        "bias": (
            dict(linear_bias=True),
            "model.mlp=moe: experts carry no biases (Mixtral, Qwen-MoE): set "
            "model.linear_bias=false",
        ),
        "freq": (dict(moe_layer_freq=0), "model.moe_layer_freq=0 must be >= 1"),
    }
    for overrides, message in cases.values():
        with pytest.raises(ValueError) as error:
            _cfg(**overrides)
        assert str(error.value) == message
    # MoE runs at tp > 1 (tests/test_moe_tp.py): each expert's width must split over TP.
    ModelConfig(**{**_cfg().to_dict()}).validate(tp_size=2)  # experts of width 12
    for overrides, message in (
        (
            dict(moe_ffn_hidden_size=10),
            "model.moe_ffn_hidden_size=10 is not divisible by tp_size=4",
        ),
        (
            dict(moe_shared_ffn_hidden_size=9),
            "model.moe_shared_ffn_hidden_size=9 is not divisible by tp_size=4",
        ),
    ):
        with pytest.raises(ValueError) as error:
            ModelConfig(**{**_cfg(**overrides).to_dict()}).validate(tp_size=4)
        assert str(error.value) == message


def test_every_kth_layer_holds_the_experts():
    cfg = _cfg(num_layers=4, moe_layer_freq=2)
    names = [spec_for(cfg, layer=i).mlp.__name__ for i in range(4)]
    assert names == ["ParallelMLP", "MoEMLP", "ParallelMLP", "MoEMLP"]


def _train_step(cfg: ModelConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss with the router losses, every gradient) of one step from seed 0."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=F64, device=DEVICE)
    expected = ["ParallelMLP", "MoEMLP"] * (cfg.num_layers // 2) + ["ParallelMLP"]
    assert [type(layer.mlp).__name__ for layer in model.layers] == expected
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    batch = torch.randint(0, 64, (2, 9), generator=gen)
    loss = model.loss(batch)
    router_losses = moe_losses(model)
    assert len(router_losses) == cfg.num_layers // 2
    loss = loss + sum(one.loss for one in router_losses)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_a_tiny_model_with_experts_trains_through_the_model_builder(family):
    # Experts on every second of three layers; GPT's experts are GeLU MLPs.
    family_keys = LLAMA if family == "llama" else dict(activation="gelu_tanh")
    cfg = _cfg(num_layers=3, moe_layer_freq=2, moe_z_loss_coeff=0.01, **family_keys)
    loss, grads = _train_step(cfg)
    assert math.isfinite(loss.item())
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.1.mlp.router.weight"].abs().max() > 0
    # Whole-layer recomputation replays the routing: the same loss and gradients, router
    # losses included. float64, the same ops in the same order: equal to ~1e-16.
    again, recomputed = _train_step(_cfg(**{**cfg.to_dict(), "recompute": "full"}))
    torch.testing.assert_close(again, loss, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("activation", ["geglu", "swiglu", "gelu_tanh"])
def test_grouped_experts_apply_every_activation_a_family_uses(activation):
    """Gemma's GeGLU experts were a KeyError in every rank (the experts knew SwiGLU and
    GeLU only). Each expert's rows against the activation written out by hand from its
    fc1 columns (interleaved gate, up pairs when gated) and fc2; float64, the same
    products: 1e-12."""
    from layers.kernel_set import TORCH_KERNELS
    from layers.moe import GroupedExperts

    cfg = _cfg(activation=activation)
    experts = GroupedExperts(cfg, TORCH_KERNELS, dtype=F64, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    counts = torch.tensor([2, 0, 3, 1, 0, 4])
    rows = _randn(int(counts.sum()), H, gen=gen)
    got = experts(rows, counts)
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = rows[start : start + n] @ experts.fc1[e]
        if activation == "gelu_tanh":
            a = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        else:
            gate, up = h[:, 0::2], h[:, 1::2]
            if activation == "swiglu":
                a = gate * torch.sigmoid(gate) * up
            else:
                g = (
                    0.5
                    * gate
                    * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
                )
                a = g * up
        want.append(a @ experts.fc2[e])
        start += n
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-12, atol=1e-12)
