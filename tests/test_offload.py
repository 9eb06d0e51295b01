"""``parallel.offload=optimizer``: the sharded modes step their optimizer state in host
memory. Against the same run on the device (bitwise), against an unsplit torch AdamW, a
checkpoint saved offloaded and resumed on the device, and the config's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import parallel_state
from engine import preflight
from engine.checkpoint import full_optimizer_state, load_checkpoint, save_checkpoint
from engine.config import Config
from engine.models import build_model
from engine.models.config import preset
from parallel_state.dims import ParallelDims
from tests.multiproc import run_ranks
from tests.test_fsdp import CFG, _named_states, _reference, _train, _unsplit
from tests.torch_reference import cpu_data_parallel

F64 = torch.float64


def _storages(tensors) -> set[int]:
    """The data pointers of the storages behind ``tensors`` (DTensors: this rank's part)."""
    parts = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return {t.untyped_storage().data_ptr() for t in parts}


def _where_state_lives(model, dp) -> dict:
    """Whether the stepped optimizer's state tensors (moments, host masters) are CPU tensors
    whose storage no parameter shares; and the state bytes on the device and the host."""
    inner = getattr(dp.optimizer, "inner", dp.optimizer)  # ZeRO-1's AdamW over its slices
    stepped = [p for g in inner.param_groups for p in g["params"]]
    state = [v for st in inner.state.values() for v in st.values() if v.dim()]
    host = getattr(getattr(dp.optimizer, "host", None), "masters", [])  # ZeRO-1's masters
    params = _storages(model.parameters())
    return {
        "cpu": all(t.device.type == "cpu" for t in state + stepped),
        "separate": not (_storages(state + host) & params),
        "device_bytes": dp.state_bytes(),
        "host_bytes": dp.host_state_bytes(),
    }


def _offloaded_vs_on_device(mode: str) -> dict:
    """``mode`` at tp 1 × dp 2 in fp64, offloaded and not (the same initial weights, 5
    steps of 2 micro-batches: tests/test_fsdp.py's sequence), and the unsplit reference."""
    ps = parallel_state.initialize(ParallelDims(1, 2))
    torch.manual_seed(0)
    initial = _unsplit(F64).full_state_dict()
    ref_losses, ref = _reference(initial)
    out = {}
    for offload in ("none", "optimizer"):
        seen = {}

        def after(model, dp, seen=seen):
            seen.update(_where_state_lives(model, dp), states=_named_states(model, dp))

        losses, params, _ = _train(ps, mode, CFG, initial, dtype=F64, after=after, offload=offload)
        out[offload] = {"losses": losses, "params": params, **seen}
    out["reference"] = {"losses": ref_losses, "params": ref}
    if mode == "optimizer":  # bf16 parameters: the fp32 masters are separate tensors
        out["bf16"] = [
            _train(
                ps,
                mode,
                CFG,
                initial,
                dtype=torch.float32,
                low_precision=torch.bfloat16,
                offload=offload,
            )
            for offload in ("none", "optimizer")
        ]
    parallel_state.destroy()
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.slow  # two ranks, five steps, the unsplit reference: ~3.5 s on idle cores
@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_offloaded_steps_equal_the_on_device_run_and_unsplit_adamw(mode):
    """Bitwise (torch.equal) against the same run without offload: on this CPU machine
    both run the same AdamW ops in the same order on the same device type (the CPU), only
    on separate buffers, so not one bit may differ (on a GPU the host AdamW is another
    kernel than the device's and only the 1e-12 check would hold). 1e-12 (fp64) against
    one process on the whole batch with torch's AdamW: only summation orders differ, as
    in tests/test_fsdp.py (there 1e-10 over every mode; ~1e-14 seen here)."""
    res = run_ranks(_offloaded_vs_on_device, 2, mode, timeout=120)
    for rank, r in enumerate(res):
        on, off, ref = r["none"], r["optimizer"], r["reference"]
        assert off["losses"] == on["losses"], (rank, off["losses"], on["losses"])
        for name, w in on["params"].items():
            assert torch.equal(off["params"][name], w), (rank, name)
        for name, st in on["states"].items():
            for key, v in st.items():
                got = off["states"][name][key]
                assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), (rank, name, key)
        for name, w in ref["params"].items():
            assert _rel(off["params"][name], w) <= 1e-12, (rank, name)
        assert (
            max(abs(a - b) / b for a, b in zip(off["losses"], ref["losses"], strict=True)) <= 1e-12
        )
        # Offloaded: AdamW's state is CPU tensors of their own (not views of parameters),
        # the device-side optimizer holds none of it and the host holds it all.
        assert off["cpu"] and off["separate"], (rank, off)
        assert off["device_bytes"] == 0 and on["host_bytes"] == 0, (rank, off, on)
        assert off["host_bytes"] >= on["device_bytes"] > 0, (rank, off, on)
        if mode == "optimizer":  # bf16 weights and fp32 masters: bitwise too
            (losses, weights, masters), (off_losses, off_weights, off_masters) = r["bf16"]
            assert off_losses == losses and masters.keys() == off_masters.keys() != set()
            assert all(torch.equal(off_weights[k], v) for k, v in weights.items()), rank
            assert all(torch.equal(off_masters[k], v) for k, v in masters.items()), rank


def _save_offloaded_resume_on_device(root: str, mode: str) -> dict:
    """``mode`` at dp 2, offloaded: the steps, save; a fresh model (another init) under
    ``mode`` on the device loads it."""
    ps = parallel_state.initialize(ParallelDims(1, 2))
    torch.manual_seed(0)
    initial = _unsplit(F64).full_state_dict()

    def save(model, dp):
        moments = full_optimizer_state(model, dp)
        save_checkpoint(root, 2, model=model, optimizer=dp, ps=ps, state={"data": {}})
        saved.update(params=model.full_state_dict(), moments=moments)

    saved = {}
    _train(ps, mode, CFG, initial, dtype=F64, after=save, offload="optimizer")
    torch.manual_seed(1)  # a different init: everything must come from the checkpoint
    model = build_model(CFG, ps, dtype=F64)
    dp = cpu_data_parallel(model, ps.dp_group, ps.tp_group, dp_shard=mode)
    load_checkpoint(root, model=model, optimizer=dp, ps=ps, log=lambda msg: None)
    params, moments = model.full_state_dict(), full_optimizer_state(model, dp)
    parallel_state.destroy()
    return {
        "params": all(torch.equal(params[k], v) for k, v in saved["params"].items()),
        "moments": moments.keys() == saved["moments"].keys()
        and all(torch.equal(moments[k], v) for k, v in saved["moments"].items()),
    }


@pytest.mark.parametrize("mode", ["optimizer", pytest.param("full", marks=pytest.mark.slow)])
def test_a_checkpoint_saved_offloaded_resumes_on_the_device_exactly(tmp_path, mode):
    """Exact (torch.equal): saving gathers the host moments as it gathers device ones."""
    root = str(tmp_path / "ckpt")
    for r in run_ranks(_save_offloaded_resume_on_device, 2, root, mode, timeout=120):
        assert r == {"params": True, "moments": True}, r


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("parallel.offload=optimizer",),
            "parallel.offload=optimizer moves the sharded optimizer state to the CPU, and "
            "parallel.dp_shard=none shards none",
        ),
        (("parallel.offload=disk",), "parallel.offload='disk' is not one of none, optimizer"),
        (
            ("parallel.offload=optimizer", "parallel.dp_shard=optimizer", "optim.impl=apex"),
            "apex's FusedAdam runs on the GPU only: set optim.impl=auto",
        ),
    ],
)
def test_offload_misuse_is_refused_in_one_line(overrides, message):
    """One line naming the value and the fix, from the config's own validation."""
    from engine.config import parallel_dims, validate
    from tests.test_engine import compose_config

    cfg = compose_config("tp_size=1", "dp_size=2", *overrides)
    problems = [p for p in validate(cfg, parallel_dims(cfg, 2)) if "offload" in p]
    assert len(problems) == 1 and message in problems[0], problems


def _preflight_at(mode: str, offload: str):
    """gpt_tiny at dp 4, fp32, ``parallel.dp_shard=mode`` and ``parallel.offload``."""
    cfg = Config(model=preset("gpt_tiny", vocab_size=8192), tp_size=1, dp_size=4)
    parallel = dataclasses.replace(cfg.parallel, dp_shard=mode, offload=offload)
    return dataclasses.replace(cfg, parallel=parallel)


@pytest.mark.parametrize(
    ("mode", "host_per_param", "grads_left"),
    [("optimizer", 8 / 4 + 4 / 4, True), ("gradients", 4 / 4 + 12 / 4, False)],
)
def test_preflight_counts_offloaded_state_on_the_host(mode, host_per_param, grads_left):
    """By hand per parameter at dp 4, fp32: ZeRO-1 offloaded keeps its parameters (4) and
    gradient buffer (4) on the device and puts the moments (8/d) and its host copy of the
    gradient slice (4/d) on the host; FSDP (CPUOffloadPolicy) moves the sharded gradients
    (4/d) and master + moments (12/d). Exact: sums of a few binary fractions."""
    n = preflight.params_count(_preflight_at(mode, "none").model)
    on = preflight.estimate_rank_bytes(_preflight_at(mode, "none"), 4, fp32_activations=True)
    off = preflight.estimate_rank_bytes(_preflight_at(mode, "optimizer"), 4, fp32_activations=True)
    assert on.host == 0 and off.optimizer == 0 and off.host == host_per_param * n
    assert off.params == on.params and off.activations == on.activations
    assert off.grads == (on.grads if grads_left else 0)


def test_preflight_line_names_the_host_bytes(monkeypatch):
    """The refusal line says what is offloaded; on a CPU machine that RAM counts too."""
    cfg = _preflight_at("optimizer", "optimizer")
    need = preflight.estimate_rank_bytes(cfg, 4, fp32_activations=True)
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: int(need.total))
    (line,) = preflight.check_memory(cfg, local_ranks=1, on_gpu=False)
    assert f"and {need.host / 2**30:.2f} GiB of optimizer state in host memory" in line
