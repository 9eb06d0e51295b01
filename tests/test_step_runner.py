"""The step runners (engine/runner): the local loop against a plain torch step, and the
interface both runners present to the trainer."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from engine.models.config import preset
from engine.pipeline import PipelineRunner
from engine.runner import LocalRunner, StepRunner
from tests.multiproc import run_ranks

VOCAB = 500


def _local_step_and_reference() -> dict[str, object]:
    """One rank: the local runner's loss and gradients for 2 micro-batches of a tiny fp64
    GPT, and the reference's: F.cross_entropy over the same model's logits on the
    concatenated batch, one backward, no runner and no accumulation."""
    import parallel_state
    from engine.config import OptimConfig
    from engine.data_parallel import build_data_parallel
    from engine.models import build_model

    ps = parallel_state.initialize(1, 1)
    cfg = preset(
        "gpt_tiny",
        vocab_size=VOCAB,
        hidden_size=32,
        num_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    ps.seed(7)
    model = build_model(cfg, ps, dtype=torch.float64)
    reference = build_model(cfg, ps, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    batch = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(11))
    micro_batches = list(batch.chunk(2))  # token windows [2, 17], as the loader yields them

    dp = build_data_parallel(
        model, OptimConfig(), grad_group=ps.group("grad"), tp_group=ps.group("tp"), device=ps.device
    )
    runner = LocalRunner(model, ps, contextlib.nullcontext)
    loss = runner.forward_backward(micro_batches, dp).item()
    dp.finish_grads()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    logits = reference(batch[:, :-1])[..., :VOCAB]  # [b, s, V]: the padding columns cut
    want_loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters()}
    return {"loss": loss, "want_loss": want_loss.item(), "grads": got, "want_grads": want}


def test_local_runner_matches_a_plain_torch_step():
    """fp64 gradients, tolerance 1e-12: the runner divides each micro-batch's mean loss by
    2 and accumulates two backwards; the reference takes one mean over all 128 tokens (the
    micro-batches hold equally many) through F.cross_entropy. The same sums in another
    order, so only rounding differs (~1e-16 relative); 1e-12 leaves room for it and none
    for a wrong scale, a dropped micro-batch or a doubled one. The loss comes back as the
    trainer logs it, in float32 (each half rounded to it, then summed there): three
    roundings of 2**-24 at most, so 2e-7 relative."""
    (out,) = run_ranks(_local_step_and_reference, 1)
    torch.testing.assert_close(out["loss"], out["want_loss"], rtol=2e-7, atol=0.0)
    assert out["grads"].keys() == out["want_grads"].keys()
    for name, grad in out["grads"].items():
        torch.testing.assert_close(grad, out["want_grads"][name], rtol=1e-12, atol=1e-12, msg=name)


def test_both_runners_present_the_step_interface():
    """The trainer calls these on whichever runner it was given; each runner has them all."""
    members = [
        name
        for name in StepRunner.__dict__
        if not name.startswith("_") and name not in ("model", "sample_refusal")
    ]
    assert len(members) == 7, members
    for runner in (LocalRunner, PipelineRunner):
        missing = [m for m in members if not callable(getattr(runner, m, None))]
        assert not missing, (runner.__name__, missing)
        assert hasattr(runner, "sample_refusal")
    assert LocalRunner.sample_refusal is None
    assert PipelineRunner.sample_refusal == "no sample: generation runs unpipelined (pp_size=1)"
