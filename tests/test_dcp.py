"""PyTorch Distributed Checkpoint interop: ``tools/checkpoint.py export-dcp`` / ``import-dcp``."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from engine.checkpoint import full_optimizer_state, load_checkpoint, save_checkpoint
from engine.config import OptimConfig
from engine.models import build_model
from engine.optim import build_optimizer
from tests.test_checkpoint import corpus, run_config  # noqa: F401 - corpus is a fixture
from tests.test_engine import ROOT
from tests.torch_reference import tiny_gpt

sys.path.insert(0, str(ROOT / "tools"))
import checkpoint as checkpoint_cli  # noqa: E402 - tools/checkpoint.py

CFG = tiny_gpt(500)
ONE = ("tp_size=1", "dp_size=1", "checkpoint.every=2")


def _trained(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = build_model(CFG)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2), torch.device("cpu"))
    for i in range(steps):
        x = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(seed + i))
        model(x[:, :-1], x[:, 1:]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _plain_state(model) -> dict:
    """A plain torch state dict of our names (no meshtron type in it), zero-filled."""
    moments = {"exp_avg": None, "exp_avg_sq": None}
    return {
        "model": {n: torch.zeros(p.shape) for n, p in model.full_state_dict().items()},
        "optim": {
            "state": {
                n: {**{k: torch.zeros(p.shape) for k in moments}, "step": torch.tensor(0.0)}
                for n, p in model.full_state_dict().items()
            }
        },
    }


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def test_export_dcp_is_read_by_torch_into_a_plain_state_dict(tmp_path, capsys):
    """(a) A directory written by export-dcp loads with ``torch.distributed.checkpoint.load``
    into a plain state dict built here: every weight, Adam moment and step identical."""
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "ck", 2, model=model, optimizer=optimizer, ps=None, state={})
    out = tmp_path / "dcp"
    # OUT as --out, the other subcommands' spelling (it was "unrecognized arguments")
    assert checkpoint_cli.main(["export-dcp", str(tmp_path / "ck"), "--out", str(out)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    plain = _plain_state(model)
    plain["meshtron"] = {"step": torch.tensor(0, dtype=torch.int64)}
    _quiet(dcp.load, plain, checkpoint_id=str(out), no_dist=True)
    weights, moments = model.full_state_dict(), full_optimizer_state(model, optimizer)
    assert plain["meshtron"]["step"].item() == 2
    for name, value in weights.items():
        assert torch.equal(plain["model"][name], value), name
        got = plain["optim"]["state"][name]
        assert torch.equal(got["exp_avg"], moments[f"optim/{name}/exp_avg"]), name
        assert torch.equal(got["exp_avg_sq"], moments[f"optim/{name}/exp_avg_sq"]), name
        assert got["step"].item() == 2.0
    # A second export into the now non-empty directory is refused, nothing changed.
    assert checkpoint_cli.main(["export-dcp", str(tmp_path / "ck"), str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err


def _torch_saved(tmp_path: Path, model) -> dict:
    """A DCP directory of our names written by torch's own ``dcp.save`` (random values,
    step 5); returns the plain state dict saved."""
    gen = torch.Generator().manual_seed(11)
    plain = _plain_state(model)
    for name, t in plain["model"].items():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
        for key, m in plain["optim"]["state"][name].items():
            if key == "step":
                m.fill_(5.0)
            else:
                m.copy_(torch.rand(m.shape, generator=gen) * (1e-3 if key == "exp_avg" else 1e-6))
    _quiet(dcp.save, plain, checkpoint_id=str(tmp_path / "torch_dcp"), no_dist=True)
    return plain


def test_torch_saved_dcp_is_imported_and_trained(tmp_path, capsys):
    """(b) torch's ``dcp.save`` of a plain state dict with our names, imported (config from
    ``--like``): it loads with the saved weights and moments bitwise, then trains."""
    model, optimizer = _trained()
    save_checkpoint(tmp_path / "like", 2, model=model, optimizer=optimizer, ps=None, state={})
    plain = _torch_saved(tmp_path, model)
    out = tmp_path / "imported"
    # Without a model config (torch's directory records none) the import is refused.
    assert checkpoint_cli.main(["import-dcp", str(tmp_path / "torch_dcp"), str(out)]) == 2
    assert "--like" in capsys.readouterr().err
    args = ["import-dcp", str(tmp_path / "torch_dcp"), str(out), "--like", str(tmp_path / "like")]
    assert checkpoint_cli.main(args) == 0
    fresh, fresh_opt = _trained(seed=3, steps=1)
    loaded = load_checkpoint(out, model=fresh, optimizer=fresh_opt, ps=None, log=print)
    assert loaded.step == 0  # torch's directory has no meshtron.step
    weights, moments = fresh.full_state_dict(), full_optimizer_state(fresh, fresh_opt)
    for name, value in weights.items():
        assert torch.equal(value, plain["model"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[f"optim/{name}/{key}"], plain["optim"]["state"][name][key])
    x = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        loss = fresh(x[:, :-1], x[:, 1:]).mean()
        loss.backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
        assert math.isfinite(loss.item())


@pytest.mark.slow
def test_dcp_round_trip_resumes_a_pretrain_run(corpus, tmp_path):  # noqa: F811
    """A run's checkpoint through export-dcp, torch (load, scale the weights, dcp.save) and
    import-dcp resumes in the engine at the exported step, loss finite."""
    from engine.worker import run_worker

    first = run_config(corpus, tmp_path / "run", "trainer.max_steps=2", *ONE)
    run_worker(first)
    assert checkpoint_cli.main(["export-dcp", str(tmp_path / "run"), str(tmp_path / "d")]) == 0
    reader = dcp.FileSystemReader(str(tmp_path / "d"))
    meta = reader.read_metadata().state_dict_metadata
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    _quiet(dcp.load, flat, storage_reader=reader, no_dist=True)
    for key, t in flat.items():
        if key.startswith("model."):
            t.mul_(0.5)
    _quiet(dcp.save, flat, checkpoint_id=str(tmp_path / "d2"), no_dist=True)
    assert checkpoint_cli.main(["import-dcp", str(tmp_path / "d2"), str(tmp_path / "back")]) == 0
    again = run_config(corpus, tmp_path / "back", "trainer.max_steps=4", *ONE)
    history = run_worker(again)["history"]
    assert [s for s, _ in history] == [3, 4]
    assert all(math.isfinite(loss) for _, loss in history)
