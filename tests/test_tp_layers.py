"""Every tensor-parallel layer against the unsplit torch reference built from the same weights.

Each TP size runs once on real gloo ranks and checks all layers there, in float64 and
float32. Error is measured as max|split − ref| / max|ref| over the tensor.

Tolerances:
- float64 ≤ 1e-12: the split computation only reorders sums (partial products summed by
  the all-reduce), which perturbs results by a few ulps of float64 (~1e-16) times the
  reduction length; 1e-12 leaves room for that and nothing more.
- float32 ≤ 1e-5: the same reordering at float32 ulp (~6e-8) over sums of ≤ 64 terms.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parallel_state
from layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    pad_vocab_size,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
    shard,
    vocab_parallel_cross_entropy,
)
from tests.fresh_buffers import FreshBuffers
from tests.multiproc import run_ranks

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
IN, OUT, SEQ, BATCH, VOCAB = 24, 36, 12, 2, 48  # every split size divides by 1, 2, 3 and 4


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


class Checker:
    """Collects the worst error per check and fails on the first one over tolerance."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.worst = dtype, {}

    def __call__(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        assert actual.shape == expected.shape, f"{name}: {actual.shape} vs {expected.shape}"
        err = rel_err(actual.detach(), expected.detach())
        self.worst[name] = max(err, self.worst.get(name, 0.0))
        assert err <= TOL[self.dtype], (
            f"{name} ({self.dtype}): rel err {err:.3e} > {TOL[self.dtype]}"
        )


def _linear_checks(ps, dtype, check):
    rank, tp = ps.tp_rank, ps.tp_size
    w1, b1 = torch.randn(OUT, IN, dtype=dtype), torch.randn(OUT, dtype=dtype)
    w2, b2 = torch.randn(IN, OUT, dtype=dtype), torch.randn(IN, dtype=dtype)
    x_full = torch.randn(SEQ, BATCH, IN, dtype=dtype)
    grad_y = torch.randn(SEQ, BATCH, OUT, dtype=dtype)
    grad_z = torch.randn(SEQ, BATCH, IN, dtype=dtype)

    def reference(module_fn, grad):
        x = x_full.clone().requires_grad_(True)
        y = module_fn(x)
        y.backward(grad)
        return y, x.grad

    ref1 = nn.Linear(IN, OUT, dtype=dtype)
    ref1.weight.data.copy_(w1), ref1.bias.data.copy_(b1)
    y_ref, gx_ref = reference(ref1, grad_y)

    for gather in (True, False):  # column-parallel, output gathered or left sharded
        col = ColumnParallelLinear.from_full(w1, b1, gather_output=gather, dtype=dtype)
        assert col.weight.shape == (OUT // tp, IN) and col.bias.shape == (OUT // tp,)
        x = x_full.clone().requires_grad_(True)
        y = col(x)
        y.backward(grad_y if gather else shard(grad_y, -1, rank, tp))
        check(f"column(gather={gather}).out", y, y_ref if gather else shard(y_ref, -1, rank, tp))
        if gather:  # sharded output: each rank's input grad is partial until f's all-reduce
            check("column.grad_input", x.grad, gx_ref)
        check("column.grad_weight", col.weight.grad, shard(ref1.weight.grad, 0, rank, tp))
        check("column.grad_bias", col.bias.grad, shard(ref1.bias.grad, 0, rank, tp))
        ref1.zero_grad()
        y_ref, gx_ref = reference(ref1, grad_y)

    # column with sharded output and per-rank output grads: input grad needs f's all-reduce
    col = ColumnParallelLinear.from_full(w1, b1, dtype=dtype)
    x = x_full.clone().requires_grad_(True)
    col(x).backward(shard(grad_y, -1, rank, tp))
    check("column(f backward).grad_input", x.grad, gx_ref)

    ref2 = nn.Linear(OUT, IN, dtype=dtype)
    ref2.weight.data.copy_(w2), ref2.bias.data.copy_(b2)
    x2_full = torch.randn(SEQ, BATCH, OUT, dtype=dtype)
    for parallel_input in (True, False):
        row = RowParallelLinear.from_full(w2, b2, input_is_parallel=parallel_input, dtype=dtype)
        assert row.weight.shape == (IN, OUT // tp) and row.bias.shape == (IN,)
        x_ref = x2_full.clone().requires_grad_(True)
        ref2.zero_grad()
        z_ref = ref2(x_ref)
        z_ref.backward(grad_z)
        x = (shard(x2_full, -1, rank, tp) if parallel_input else x2_full.clone()).requires_grad_()
        z = row(x)
        z.backward(grad_z)
        expected_gx = shard(x_ref.grad, -1, rank, tp) if parallel_input else x_ref.grad
        check(f"row(parallel_input={parallel_input}).out", z, z_ref)
        check("row.grad_input", x.grad, expected_gx)
        check("row.grad_weight", row.weight.grad, shard(ref2.weight.grad, 1, rank, tp))
        check("row.grad_bias", row.bias.grad, ref2.bias.grad)

    # Column -> GeLU -> Row MLP against nn.Sequential on the same weights.
    mlp_ref = nn.Sequential(ref1, nn.GELU(), ref2)
    ref1.zero_grad(), ref2.zero_grad()
    out_ref, gx_ref = reference(mlp_ref, grad_z)
    col = ColumnParallelLinear.from_full(w1, b1, dtype=dtype)
    row = RowParallelLinear.from_full(w2, b2, dtype=dtype)
    x = x_full.clone().requires_grad_(True)
    out = row(F.gelu(col(x)))
    out.backward(grad_z)
    check("mlp.out", out, out_ref)
    check("mlp.grad_input", x.grad, gx_ref)
    check("mlp.fc1.grad_weight", col.weight.grad, shard(ref1.weight.grad, 0, rank, tp))
    check("mlp.fc1.grad_bias", col.bias.grad, shard(ref1.bias.grad, 0, rank, tp))
    check("mlp.fc2.grad_weight", row.weight.grad, shard(ref2.weight.grad, 1, rank, tp))
    check("mlp.fc2.grad_bias", row.bias.grad, ref2.bias.grad)

    # Sequence-parallel MLP: input and output sharded along the sequence (dim 0).
    col = ColumnParallelLinear.from_full(w1, b1, dtype=dtype, sequence_parallel=True)
    row = RowParallelLinear.from_full(w2, b2, dtype=dtype, sequence_parallel=True)
    x = shard(x_full, 0, rank, tp).requires_grad_(True)
    out = row(F.gelu(col(x)))
    out.backward(shard(grad_z, 0, rank, tp))
    check("sp_mlp.out", out, shard(out_ref, 0, rank, tp))
    check("sp_mlp.grad_input", x.grad, shard(gx_ref, 0, rank, tp))
    check("sp_mlp.fc1.grad_weight", col.weight.grad, shard(ref1.weight.grad, 0, rank, tp))
    check("sp_mlp.fc2.grad_weight", row.weight.grad, shard(ref2.weight.grad, 1, rank, tp))
    # The replicated row bias sees only this rank's sequence shard: summing over TP is
    # grad_sync's job; here check the partial equals the reference restricted to the shard.
    check("sp_mlp.fc2.grad_bias(partial)", row.bias.grad, shard(grad_z, 0, rank, tp).sum((0, 1)))


def _embedding_and_loss_checks(ps, dtype, check):
    rank, tp = ps.tp_rank, ps.tp_size
    table = torch.randn(VOCAB, 16, dtype=dtype)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH))
    grad = torch.randn(SEQ, BATCH, 16, dtype=dtype)
    ref = nn.Embedding(VOCAB, 16, dtype=dtype)
    ref.weight.data.copy_(table)
    ref(ids).backward(grad)
    for sp in (False, True):
        emb = VocabParallelEmbedding.from_full(table, dtype=dtype, sequence_parallel=sp)
        emb.weight.grad = None
        out = emb(ids)
        out.backward(shard(grad, 0, rank, tp) if sp else grad)
        check(f"embedding(sp={sp}).out", out, shard(ref(ids), 0, rank, tp) if sp else ref(ids))
        check("embedding.grad_weight", emb.weight.grad, shard(ref.weight.grad, 0, rank, tp))

    _loss_checks(ps, dtype, check, compiled=False)


def _loss_checks(ps, dtype, check, *, compiled: bool) -> None:
    """The vocab-parallel cross-entropy against F.cross_entropy on the gathered, unpadded
    logits; ``compiled``: its traced form, under torch.compile (aot_eager, one graph)."""
    rank, tp, group = ps.tp_rank, ps.tp_size, ps.tp_group
    real_vocab = VOCAB - 5  # the last 5 columns are padding and must get no probability
    logits_full = torch.randn(SEQ, BATCH, VOCAB, dtype=dtype) * 3
    target = torch.randint(0, real_vocab, (SEQ, BATCH))
    target[0, 0] = target[3, 1] = -100
    grad_loss = torch.rand(SEQ, BATCH, dtype=dtype)
    # VOCAB // tp - 1: at tp > 1 every rank past the first holds padding only.
    for smoothing in (0.0, 0.1):
        for vocab_size in (None, real_vocab, VOCAB // tp - 1):
            cols = VOCAB if vocab_size is None else vocab_size
            target = torch.where(target == -100, target, target % cols)
            ref_logits = logits_full[..., :cols].clone().requires_grad_(True)
            ref_loss = F.cross_entropy(
                ref_logits.reshape(-1, cols),
                target.reshape(-1),
                label_smoothing=smoothing,
                reduction="none",
            ).view(SEQ, BATCH)
            ref_loss.backward(grad_loss)
            ref_grad = F.pad(ref_logits.grad, (0, VOCAB - cols))  # padded columns: zero grad
            local = shard(logits_full, -1, rank, tp).requires_grad_(True)

            def loss_of(x, target=target, smoothing=smoothing, vocab_size=vocab_size):
                return vocab_parallel_cross_entropy(
                    x, target, label_smoothing=smoothing, vocab_size=vocab_size, tp_group=group
                )

            if compiled:
                torch._dynamo.reset()
                loss_of = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
            loss = loss_of(local)
            loss.backward(grad_loss)
            tag = f"cross_entropy(smoothing={smoothing}, vocab={cols}, compiled={compiled})"
            check(f"{tag}.loss", loss, ref_loss)
            check(f"{tag}.grad", local.grad, shard(ref_grad, -1, rank, tp))
            assert (loss[0, 0] == 0) and (local.grad[0, 0] == 0).all(), "ignore_index leaked"


def _operator_checks(ps, dtype, check):
    """The conjugate pairs against hand-derived results (rank r contributes (r+1)·ones)."""
    rank, tp = ps.tp_rank, ps.tp_size
    total = tp * (tp + 1) / 2  # Σ_r (r+1)
    base = torch.arange(1.0, 1 + 4 * tp * 3, dtype=dtype).view(4 * tp, 3)
    mine = torch.full_like(base, rank + 1.0)

    x = base.clone().requires_grad_(True)
    y = copy_to_tp(x)
    y.backward(mine)
    check("copy.forward", y, base)
    check("copy.backward", x.grad, torch.full_like(base, total))

    x = mine.clone().requires_grad_(True)
    y = reduce_from_tp(x)
    y.backward(base)
    check("reduce.forward", y, torch.full_like(base, total))
    check("reduce.backward", x.grad, base)

    x = base.clone().requires_grad_(True)
    y = scatter_to_tp(x.t())  # last dim has 4·tp entries
    y.backward(torch.ones_like(y) * (rank + 1))
    check("scatter.forward", y, shard(base.t(), -1, rank, tp))
    expected = torch.cat([torch.full((3, 4), r + 1.0, dtype=dtype) for r in range(tp)], -1)
    check("scatter.backward", x.grad.t(), expected)

    x = mine.t().clone().requires_grad_(True)
    y = gather_from_tp(x)
    y.backward(base.t().repeat(1, tp))
    gathered = torch.cat([torch.full((3, 4 * tp), r + 1.0, dtype=dtype) for r in range(tp)], -1)
    check("gather.forward", y, gathered)
    check("gather.backward", x.grad, shard(base.t().repeat(1, tp), -1, rank, tp))

    x = base.clone().requires_grad_(True)
    y = scatter_to_sequence(x, dim=0)
    y.backward(torch.full_like(y, rank + 1.0))
    check("sp_scatter.forward", y, shard(base, 0, rank, tp))
    seq_expected = torch.cat([torch.full((4, 3), r + 1.0, dtype=dtype) for r in range(tp)], 0)
    check("sp_scatter.backward", x.grad, seq_expected)

    x = torch.full((4, 3), rank + 1.0, dtype=dtype, requires_grad=True)
    y = gather_from_sequence(x, dim=0)
    y.backward(base * (rank + 1))
    check("sp_gather.forward", y, seq_expected)
    check("sp_gather.backward", x.grad, shard(base, 0, rank, tp) * total)

    x = mine.clone().requires_grad_(True)
    y = reduce_scatter_to_sequence(x, dim=0)
    y.backward(torch.full_like(y, rank + 1.0))
    check("sp_reduce_scatter.forward", y, torch.full((4, 3), total, dtype=dtype))
    check("sp_reduce_scatter.backward", x.grad, seq_expected)


def _all_layer_checks(tp: int) -> dict[str, float]:
    ps = parallel_state.initialize(tp)
    worst = {}
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(1234)  # same full weights and batch on every rank
        check = Checker(dtype)
        _operator_checks(ps, dtype, check)
        _linear_checks(ps, dtype, check)
        _embedding_and_loss_checks(ps, dtype, check)
        worst[str(dtype)] = max(check.worst.values())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_layers_match_unsplit_reference(tp):
    worst = run_ranks(_all_layer_checks, tp, tp)
    print(f"tp={tp} worst relative error per dtype: {worst[0]}")


def _init_matches_serial(tp: int) -> None:
    """Layers built from the same seed hold the slices of the serial layer's N(0, 0.02) draws."""
    ps = parallel_state.initialize(tp)
    ps.seed(7)
    col = ColumnParallelLinear(IN, OUT)
    row = RowParallelLinear(OUT, IN)
    emb = VocabParallelEmbedding(VOCAB, 16)
    torch.manual_seed(7)  # serial reference: the same draws in the same order, then slice
    w_col = torch.empty(OUT, IN).normal_(0, 0.02)
    w_row = torch.empty(IN, OUT).normal_(0, 0.02)
    w_emb = torch.empty(VOCAB, 16).normal_(0, 0.02)
    torch.testing.assert_close(col.weight.data, shard(w_col, 0, ps.tp_rank, tp), rtol=0, atol=0)
    torch.testing.assert_close(row.weight.data, shard(w_row, 1, ps.tp_rank, tp), rtol=0, atol=0)
    torch.testing.assert_close(emb.weight.data, shard(w_emb, 0, ps.tp_rank, tp), rtol=0, atol=0)


def _divisibility_errors() -> None:
    parallel_state.initialize(3)
    with pytest.raises(
        ValueError, match=r"ColumnParallelLinear out_features \(10\).*tensor-parallel size \(3\)"
    ):
        ColumnParallelLinear(6, 10)
    with pytest.raises(ValueError, match=r"RowParallelLinear in_features \(7\).*\(3\)"):
        RowParallelLinear(7, 6)
    with pytest.raises(ValueError, match=r"vocabulary size.*\(50\).*\(3\)"):
        VocabParallelEmbedding(50, 8)
    with pytest.raises(ValueError, match=r"dim 0 of a tensor of shape \(4, 2\)"):
        shard(torch.zeros(4, 2), 0, 0, 3)
    VocabParallelEmbedding(pad_vocab_size(50, 3), 8)  # the suggested fix works


@pytest.mark.slow
def test_initialization_and_errors():
    for tp in (2, 3):
        run_ranks(_init_matches_serial, tp, tp)
    run_ranks(_divisibility_errors, 3)


def test_single_process_needs_no_init():
    """Without torch.distributed the layers are plain TP=1 layers."""
    col = ColumnParallelLinear(4, 6)
    assert col.weight.shape == (6, 4) and col.tp_size == 1


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 128) == 50304  # GPT-2's well-known padded size
    assert pad_vocab_size(50304, 128) == 50304
    assert pad_vocab_size(1001, 2 * 128) == 1024
    with pytest.raises(ValueError, match="must be >= 1"):
        pad_vocab_size(0, 128)


def test_cross_entropy_argument_errors():
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(
            torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), label_smoothing=1.5
        )
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"vocab_size 5 must be in \(0, 4\]"):
        vocab_parallel_cross_entropy(
            torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), vocab_size=5
        )


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_makes_one_logits_buffer(smoothing):
    """With a padded vocabulary, forward allocates one logits-sized buffer (the softmax that
    backward reuses) and backward none: no masked copy, no second buffer for x - max."""
    logits = torch.randn(8, 64, device="cpu", requires_grad=True)
    target = torch.randint(0, 50, (8,), device="cpu")
    with FreshBuffers(logits.numel()) as forward:
        loss = vocab_parallel_cross_entropy(
            logits, target, vocab_size=50, label_smoothing=smoothing
        )
    with FreshBuffers(logits.numel()) as backward:
        loss.sum().backward()
    assert len(forward.ops) == 1, forward.ops
    assert backward.ops == [], backward.ops
    # The result itself, against F.cross_entropy on the unpadded columns (fp32, 1e-6: the
    # same sums in another order).
    ref_logits = logits.detach()[:, :50].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target, reduction="none", label_smoothing=smoothing)
    ref.sum().backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad[:, :50], ref_logits.grad, rtol=1e-6, atol=1e-6)
    assert (logits.grad[:, 50:] == 0).all()


def test_cross_entropy_target_on_padding_is_infinite():
    """A target id in the padding columns has no probability: infinite loss, as if its
    logit were -inf (the behaviour of masking the padding to -inf)."""
    logits = torch.randn(2, 8, device="cpu")
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([6, 1]), vocab_size=5)
    assert loss[0] == float("inf") and torch.isfinite(loss[1])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_compiled_cross_entropy_matches_f_cross_entropy(smoothing):
    """Under torch.compile the loss is written in differentiable ops (the compiler derives
    and fuses the backward): the same loss and gradient as F.cross_entropy on the unpadded
    columns, ignored tokens included (fp32; 1e-6: the same sums in another order)."""
    logits = torch.randn(12, 64, device="cpu", dtype=torch.float32) * 3
    target = torch.randint(0, 50, (12,), device="cpu")
    target[3] = -100

    def loss_of(x):
        return vocab_parallel_cross_entropy(x, target, vocab_size=50, label_smoothing=smoothing)

    mine = logits.clone().requires_grad_(True)
    loss = torch.compile(loss_of, backend="aot_eager", fullgraph=True)(mine)
    grad_loss = torch.rand(12)
    loss.backward(grad_loss)
    ref_logits = logits[:, :50].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target, reduction="none", label_smoothing=smoothing)
    ref.backward(grad_loss)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.grad[:, :50], ref_logits.grad, rtol=1e-6, atol=1e-6)
    assert (mine.grad[:, 50:] == 0).all()


def test_compiled_cross_entropy_backward_has_no_scatter():
    """The compiled backward forms the target's gradient by comparing column indices: no
    logits-sized zero-fill and scatter (gather's autograd backward), which cost two extra
    passes over the logits (the largest tensor of a small model's step)."""
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = []

    def keep_ops(graph, _inputs):
        backward_ops.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
        return graph.forward

    backend = aot_autograd(fw_compiler=lambda g, _: g.forward, bw_compiler=keep_ops)
    logits = torch.randn(12, 64, device="cpu", requires_grad=True)
    target = torch.randint(0, 50, (12,), device="cpu")
    loss = torch.compile(
        lambda x: vocab_parallel_cross_entropy(x, target, vocab_size=50), backend=backend
    )(logits)
    loss.sum().backward()
    assert backward_ops, "no backward graph captured"
    assert not [op for op in backward_ops if "scatter" in op or "zeros" in op], backward_ops


def _compiled_loss_checks_at_tp_2_and_3() -> dict[int, dict[str, object]]:
    """On three ranks: ``_compiled_loss_checks`` at TP=3 (the world), then at TP=2 on a
    group of ranks 0 and 1 while rank 2 waits. One set of processes for both sizes, so each
    rank pays Dynamo's one-time start (seconds) once; the loss sees only its ``tp_group``,
    so a pair inside a world of three is TP=2 as a world of two is."""
    from types import SimpleNamespace

    import torch.distributed as dist

    results = {3: _compiled_loss_checks(parallel_state.initialize(3))}
    parallel_state.destroy()
    pair = dist.new_group([0, 1])  # every rank takes part in making a group
    if dist.get_rank() < 2:
        tp2 = SimpleNamespace(tp_rank=dist.get_rank(), tp_size=2, tp_group=pair)
        results[2] = _compiled_loss_checks(tp2)
    return results


def _compiled_loss_checks(ps) -> dict[str, object]:
    """The traced cross-entropy at ``ps.tp_size`` against F.cross_entropy (fp64 and fp32,
    every vocabulary case of ``_loss_checks``), and the TP collectives of its forward graph."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    tp = ps.tp_size
    worst = {}
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(1234)  # the same full logits and targets on every rank
        check = Checker(dtype)
        _loss_checks(ps, dtype, check, compiled=True)
        worst[str(dtype)] = max(check.worst.values())
    forward_ops = []

    def keep_ops(graph, _inputs):
        forward_ops.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep_ops, bw_compiler=lambda g, _: g.forward)
    logits = torch.randn(6, VOCAB // tp, requires_grad=True)
    target = torch.randint(0, VOCAB - 5, (6,))
    loss_of = torch.compile(
        lambda x: vocab_parallel_cross_entropy(
            x, target, vocab_size=VOCAB - 5, tp_group=ps.tp_group
        ),
        backend=backend,
    )
    loss_of(logits).sum().backward()
    worst["forward collectives"] = [op for op in forward_ops if "c10d_functional" in op]
    return worst


@pytest.mark.slow
def test_compiled_cross_entropy_matches_f_cross_entropy_across_tp():
    """At TP > 1 the traced loss reduces each shard to its own max and sum of exponentials
    and sends every rank's statistics in one all-reduce: the same loss and gradients as
    F.cross_entropy on the gathered logits (fp64 1e-12, fp32 1e-5, the file's tolerances),
    with padding columns, a rank of padding only (vocabulary VOCAB // tp - 1), label
    smoothing and ignored tokens; the forward graph holds one all-reduce and its wait. At
    TP=2 and TP=3, both on one set of three ranks (rank 2 is outside the TP=2 group)."""
    ranks = run_ranks(_compiled_loss_checks_at_tp_2_and_3, 3, timeout=600.0)
    assert [sorted(r) for r in ranks] == [[2, 3], [2, 3], [3]]
    for tp, result in ((tp, r[tp]) for r in ranks for tp in sorted(r)):
        assert result["forward collectives"] == [
            "_c10d_functional.all_reduce.default",
            "_c10d_functional.wait_tensor.default",
        ], result["forward collectives"]
        print(f"tp={tp} compiled cross-entropy, worst relative error: {result}")


def _overlap_checks() -> dict[str, object]:
    """At TP=2: the op order of ColumnParallelLinear's backward, its fp64 gradients against
    the unsplit F.linear, and under bf16 autocast its numbers and saved bytes against the
    composed ``F.linear(copy_to_tp(x), W, b)``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
            self.ops.append((func.overloadpacket.__name__, shape))
            return out

    ps = parallel_state.initialize(2)
    torch.manual_seed(7)  # the same full weights and input on both ranks
    full_w = torch.randn(OUT, IN, dtype=torch.float64)
    full_b = torch.randn(OUT, dtype=torch.float64)
    x = torch.randn(SEQ, BATCH, IN, dtype=torch.float64)
    grad_y = torch.randn(SEQ, BATCH, OUT, dtype=torch.float64)
    layer = ColumnParallelLinear.from_full(
        full_w, full_b, tp_group=ps.tp_group, dtype=torch.float64
    )
    mine = x.clone().requires_grad_(True)
    y = layer(mine)
    record = Record()
    with record:
        y.backward(shard(grad_y, -1, ps.tp_rank, 2))
    names = [name for name, _ in record.ops]
    weight_grad = record.ops.index(("mm", (OUT // 2, IN)))
    ref_x, ref_w = x.clone().requires_grad_(True), full_w.clone().requires_grad_(True)
    F.linear(ref_x, ref_w, full_b).backward(grad_y)
    found = {
        "weight gradient between start and wait": (
            names.index("all_reduce") < weight_grad < names.index("wait_tensor")
        ),
        "input grad error": rel_err(mine.grad, ref_x.grad),
        "weight grad error": rel_err(layer.weight.grad, shard(ref_w.grad, 0, ps.tp_rank, 2)),
    }
    # bf16 autocast: the same numbers and saved bytes as the composed ops.
    layer32 = ColumnParallelLinear.from_full(full_w.float(), full_b.float(), tp_group=ps.tp_group)
    results = []
    for fused in (True, False):
        xi = x.float().requires_grad_(True)
        saved = []
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t.nbytes) or t, lambda t: t
        )
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                out = layer32(xi)
            else:
                out = F.linear(copy_to_tp(xi, ps.tp_group), layer32.weight, layer32.bias)
        layer32.zero_grad()
        out.float().pow(2).sum().backward()
        results.append((out, xi.grad, layer32.weight.grad, layer32.bias.grad, sum(saved)))
    (y1, gx1, gw1, gb1, saved1), (y2, gx2, gw2, gb2, saved2) = results
    found["bf16 output and gradients bitwise"] = all(
        torch.equal(a, b) for a, b in ((y1, y2), (gx1, gx2), (gw1, gw2), (gb1, gb2))
    )
    found["bf16 saved bytes"] = (saved1, saved2)
    return found


def _sequence_parallel_bf16_checks() -> dict[str, object]:
    """At TP=2 with sequence parallelism under bf16 autocast: ColumnParallelLinear against
    the composed ``F.linear(all-gather(x shard), W, b)`` (the gather in fp32, as a norm's
    output comes), its output and gradients, the bytes its all-gathers move and the bytes
    autograd saves."""
    import layers.mappings as mappings

    ps = parallel_state.initialize(2)
    torch.manual_seed(7)
    full_w, full_b = torch.randn(OUT, IN), torch.randn(OUT)
    x = torch.randn(SEQ, BATCH, IN)  # the whole sequence; each rank holds half
    layer = ColumnParallelLinear.from_full(
        full_w, full_b, tp_group=ps.tp_group, sequence_parallel=True
    )
    gathered: list[tuple[torch.dtype, int]] = []
    real = mappings.all_gather_dim

    def counting(t, *args, **kwargs):
        gathered.append((t.dtype, t.nbytes))
        return real(t, *args, **kwargs)

    results = []
    for fused in (True, False):
        xi = shard(x, 0, ps.tp_rank, 2).requires_grad_(True)
        saved, gathered[:] = [], []  # the bytes of each saved tensor but the weight itself
        weight = layer.weight.data_ptr()

        def pack(t, saved=saved, weight=weight):
            if t.data_ptr() != weight:
                saved.append(t.nbytes)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        mappings.all_gather_dim = counting
        try:
            with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
                if fused:
                    out = layer(xi)
                else:
                    total = gather_from_sequence(xi, ps.tp_group)
                    out = F.linear(total, layer.weight, layer.bias)
            layer.zero_grad()
            out.float().pow(2).sum().backward()
        finally:
            mappings.all_gather_dim = real
        grads = (xi.grad, layer.weight.grad, layer.bias.grad)
        results.append((out, *grads, sum(saved), list(gathered)))
    (y1, gx1, *gw1, saved1, gathered1), (y2, gx2, *gw2, saved2, _) = results
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip((y1, *gw1), (y2, *gw2), strict=True)),
        "input grad error": rel_err(gx1, gx2),
        "grad dtypes": [g.dtype for g in (gx1, *gw1)],
        "gathered": gathered1,
        "saved": (saved1, saved2),
        "shard bytes fp32": shard(x, 0, ps.tp_rank, 2).nbytes,
    }


def test_sequence_parallel_column_linear_gathers_in_autocast_dtype():
    """Under bf16 autocast a sequence-parallel ColumnParallelLinear gathers (forward, and
    again in backward) and saves its input shard in bf16, not the fp32 a norm hands it:
    half the bytes. The output and the weight and bias gradients are bitwise those of the
    composed fp32 gather + F.linear (autocast casts the gathered input to bf16 there;
    casting the shard first rounds the same elements the same way). The input gradient's
    reduce-scatter sums the bf16 GEMM output in bf16 (as before this change), the
    composed ops' in fp32 after the cast: one bf16 rounding apart, 2^-8 relative."""
    for found in run_ranks(_sequence_parallel_bf16_checks, 2):
        assert found["bitwise"], found
        assert found["input grad error"] <= 2**-8, found
        assert found["grad dtypes"] == [torch.float32] * 3, found  # the leaves' own dtypes
        half = found["shard bytes fp32"] // 2
        assert found["gathered"] == [(torch.bfloat16, half)] * 2, found  # forward, backward
        saved, composed = found["saved"]
        assert saved == half < composed, found  # the bf16 shard alone (and the weight)


def _model_gathers_under_bf16() -> list[str]:
    """The dtype of every tensor a GPT forward at TP=2 with sequence parallelism
    all-gathers over the sequence under bf16 autocast."""
    import layers.mappings as mappings
    from engine.models import build_model
    from engine.models.config import preset

    ps = parallel_state.initialize(parallel_state.ParallelDims(2, 1, sequence_parallel=True))
    ps.seed(3)
    cfg = preset("gpt_tiny", num_layers=2, max_positions=16, sequence_parallel=True)
    model = build_model(cfg, ps)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    seen, real = [], mappings.all_gather_dim
    mappings.all_gather_dim = lambda t, *a, **k: seen.append(str(t.dtype)) or real(t, *a, **k)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.loss(ids)
    finally:
        mappings.all_gather_dim = real
    return seen


def test_a_sequence_parallel_model_gathers_activations_in_bf16_under_autocast():
    """A GPT forward at TP=2 with SP under bf16 autocast all-gathers 5 activations, each in
    bf16: each layer's QKV and fc1 inputs, and the LM head's input, which had its own fp32
    gather and kept the whole gathered sequence for backward. (Backward gathers the
    residual stream's gradients too, which stay fp32 as the residual does.)"""
    for seen in run_ranks(_model_gathers_under_bf16, 2):
        assert seen == ["torch.bfloat16"] * 5, seen


def test_column_linear_overlaps_the_input_gradient_all_reduce():
    """f's all-reduce of the input gradient starts before the weight gradient's GEMM and is
    waited for after it (the overlap); the gradients stay the unsplit layer's (fp64,
    1e-12 as above); under bf16 autocast the output and every gradient are bitwise those
    of the composed ``F.linear(copy_to_tp(x), W, b)`` (the same kernels on the same
    operands), and autograd saves no more bytes than for the composed ops."""
    for found in run_ranks(_overlap_checks, 2):
        assert found["weight gradient between start and wait"], found
        assert found["input grad error"] <= 1e-12, found
        assert found["weight grad error"] <= 1e-12, found
        assert found["bf16 output and gradients bitwise"], found
        saved, composed = found["bf16 saved bytes"]
        assert saved <= composed, found
