"""Every bad input we know of ends in ONE line naming it, with the right exit status.

The tables below hold each bad input, the fragment its one-line message must contain and
its exit status (2: a configuration or usage error). They run through the programs' real
entry points in this process: ``engine.pretrain`` run as ``__main__`` (as ``python -m``
does, Hydra's parsing included) with ``sys.argv`` set, and each tool's ``main(argv)``. A representative subset then runs as real subprocesses, to check what
only a process shows: the exit status, a single stderr line, no traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint.manager import save_checkpoint
from engine.checkpoint.storage import read_index, write_index
from engine.config import OptimConfig
from engine.data.indexed import IndexedDataset, IndexedDatasetWriter
from engine.data.preprocess import preprocess
from engine.models import build_model
from engine.models.config import preset
from engine.optim import build_optimizer
from tests.case_table import shell_cases
from tests.launch_util import env_with_repo, run_pretrain

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 300  # the test corpus's tokenizer; the runs' model.vocab_size is 512


def _write_v1(prefix: Path, tokens: np.ndarray, offsets: list[int], eod_id: int) -> None:
    """A version-1 index (before the token range and checksum were recorded)."""
    header = struct.pack("<8sIB3xqQQ", b"MSHTIDX\0", 1, 2, eod_id, len(offsets) - 1, offsets[-1])
    Path(f"{prefix}.bin").write_bytes(tokens.astype(np.uint16).tobytes())
    Path(f"{prefix}.idx").write_bytes(header + np.asarray(offsets, np.int64).tobytes())


def _patch_idx(src: Path, dst: Path, at: int, value: int) -> None:
    """Copy the pair ``src`` to ``dst`` with the int64 at byte ``at`` of the .idx replaced."""
    shutil.copy(f"{src}.bin", f"{dst}.bin")
    data = bytearray(Path(f"{src}.idx").read_bytes())
    data[at : at + 8] = struct.pack("<q", value)
    Path(f"{dst}.idx").write_bytes(bytes(data))


def _make_data(d: Path) -> dict[str, str]:
    """A tiny corpus and its damaged variants, each a PREFIX."""
    (d / "text").mkdir()
    for doc in range(20):  # a text file is one document
        lines = (f"def f{i}(x):\n    return x * {i} + {doc}\n\n" for i in range(20))
        (d / "text" / f"{doc:02d}.txt").write_text("".join(lines))
    good = preprocess(
        [str(d / "text" / "*.txt")], str(d / "good"), vocab_size=VOCAB, progress=False
    )
    eod, prefix = IndexedDataset(good.prefix).eod_id, Path(good.prefix)
    with IndexedDatasetWriter(d / "big_ids", vocab_size=1000, eod_id=eod) as writer:
        for i in range(50):
            writer.add_document(np.arange(60) * 16 + i)  # ids up to 993: past 512
    v1_docs = [[7, 999, eod]] + [[3 + i] * 9 + [eod] for i in range(20)]  # 203 tokens
    offsets = np.cumsum([0] + [len(doc) for doc in v1_docs]).tolist()
    _write_v1(d / "v1_big_ids", np.concatenate(v1_docs), offsets, eod)
    shutil.copy(f"{prefix}.idx", d / "flipped.idx")
    data = bytearray(Path(f"{prefix}.bin").read_bytes())
    data[100] ^= 1  # one bit: size unchanged, only the checksum can tell
    (d / "flipped.bin").write_bytes(bytes(data))
    offsets_at = 40 + 48  # version-2 header, then document offsets
    _patch_idx(prefix, d / "eod_99999", 16, 99999)
    _patch_idx(prefix, d / "eod_not_at_ends", 16, eod + 1)
    _patch_idx(prefix, d / "not_monotonic", offsets_at + 8 * 2, 1)  # doc 2 starts before doc 1
    return {
        "good": str(prefix),
        "tokenizer": good.tokenizer_path,
        **{
            n: str(d / n)
            for n in (
                "big_ids",
                "v1_big_ids",
                "flipped",
                "eod_99999",
                "eod_not_at_ends",
                "not_monotonic",
            )
        },
    }


def _make_checkpoints(d: Path) -> dict[str, str]:
    """A training checkpoint (another model than the runs': vocabulary 500) and edited copies
    whose index checksum was updated, as whoever edits an index can do."""
    torch.manual_seed(0)
    cfg = preset("gpt_tiny", vocab_size=500, hidden_size=32, num_heads=4, num_layers=1)
    model = build_model(cfg)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    save_checkpoint(d / "ck", 1, model=model, optimizer=optimizer, ps=None, state={})
    out = {"ck": str(d / "ck")}
    for name, shape in (("ck_huge", [1_000_000, 1_000_000]), ("ck_shape", [64, 33])):
        shutil.copytree(d / "ck", d / name)
        step = d / name / "step_00000001"
        index = read_index(step)
        index["tensors"]["model/embedding.position"]["shape"] = shape
        write_index(step, {k: v for k, v in index.items() if k != "index_sha256"})
        out[name] = str(d / name)
    shutil.copytree(d / "ck", d / "ck_trunc")  # its only step's file cut short
    with open(d / "ck_trunc" / "step_00000001" / "rank00000.safetensors", "r+b") as f:
        f.truncate(100)
    out["ck_trunc"] = str(d / "ck_trunc")
    (d / "a_file").write_text("not a directory")
    (d / "empty_file").write_text("")
    (d / "empty_dir").mkdir()
    (d / "bad.yaml").write_text("{{{ not yaml\n")
    out |= {n: str(d / n) for n in ("a_file", "empty_file", "empty_dir")}
    out["bad_yaml"] = str(d / "bad.yaml")
    return out


def _make_hf_dirs(d: Path) -> dict[str, str]:
    config = {
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 1,
        "n_head": 4,
        "n_positions": 16,
        "vocab_size": 64,
    }
    dirs = {}
    for name in ("hf_garbage", "hf_parent", "hf_absolute", "hf_no_weights"):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(config))
        dirs[name] = str(d / name)
    (d / "hf_garbage" / "model.safetensors").write_bytes(b"\xff" * 64)
    (d / "secret.safetensors").write_bytes(b"outside the model directory")
    for name, shard in (
        ("hf_parent", "../secret.safetensors"),
        ("hf_absolute", str(d / "x.safetensors")),
    ):
        index = {"weight_map": {"transformer.wte.weight": shard}}
        (d / name / "model.safetensors.index.json").write_text(json.dumps(index))
    return dirs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad_input")
    return {"dir": str(d), **_make_data(d), **_make_checkpoints(d), **_make_hf_dirs(d)}


def _base(p: dict[str, str], prefixes: str = "good") -> list[str]:
    """A run that would be valid (and small), but for the override under test."""
    names = ",".join(p[n] for n in prefixes.split(","))
    return [
        f"data.prefixes=[{names}]",
        f"data.tokenizer={p['tokenizer']}",
        "model=gpt_tiny",
        "model.vocab_size=512",
        "data.seq_len=32",
        "tp_size=1",
        "dp_size=1",
        "trainer.max_steps=1",
        f"checkpoint.dir={p['dir']}/ck_run",
        f"hydra.run.dir={p['dir']}/hydra",
    ]


# One case a line: id, overrides ({key} = a path of the fixture), "message fragment".
# Exit status 2 for all.
PRETRAIN_CASES = """
    # issue 25: CUDA graphs where they cannot apply
    cuda_graphs_eager model.cuda_graphs=true "model.cuda_graphs=true replays the compiled step: set model.compile=true"
    cuda_graphs_dropout model.cuda_graphs=true model.compile=true "model.cuda_graphs=true needs model.hidden_dropout=0 and model.attention_dropout=0"
    cuda_graphs_cpu model.cuda_graphs=true model.compile=true model.hidden_dropout=0 model.attention_dropout=0 trainer.device=cpu "model.cuda_graphs=true replays CUDA graphs, but trainer.device=cpu"
    # issue 10 item 8: tracebacks
    beta1_2 optim.beta1=2 "optim.beta1=2.0 must be in [0, 1)"
    eps_negative optim.eps=-1 "optim.eps=-1.0 must be > 0"
    bucket_0 trainer.grad_bucket_mb=0 "trainer.grad_bucket_mb=0.0 must be > 0"
    log_every_0 trainer.log_every=0 "trainer.log_every=0 must be >= 1"
    split_abc data.split=abc "data.split='abc' is invalid"
    split_zeros "data.split='0,0,0'" "data.split='0,0,0' is invalid"
    hidden_65536 model.hidden_size=65536 "the model cannot fit: about "
    temperature_0 trainer.sample_temperature=0 "trainer.sample_temperature=0.0 must be > 0"
    wandb_missing trainer.wandb_project=x "needs wandb, which is not installed"
    other_model_ckpt checkpoint.dir={ck} "holds a run of another model (checkpoint has model.vocab_size=500, the model 512"
    init_from_missing checkpoint.init_from={dir}/none "none is not a directory: give a model export, a training checkpoint or a Hugging Face directory"
    init_from_other_model checkpoint.init_from={ck} "ck holds another model (it has model.vocab_size=500, the run 512; model.hidden_size=32, the run"
    init_from_hf_garbage checkpoint.init_from={hf_garbage} "model.safetensors is not a readable safetensors file"
    init_from_truncated checkpoint.init_from={ck_trunc} model.vocab_size=500 model.hidden_size=32 model.num_layers=1 "rank00000.safetensors holds 100 bytes, and the checkpoint's index records"
    every_checkpoint_damaged checkpoint.dir={ck_trunc} "step_00000001/rank00000.safetensors is damaged: 100 bytes, the index says"
    cache_dir_unwritable data.prefixes=[] data.default_vocab_size=512 data.cache_dir={a_file}/cache "a_file/cache cannot hold the embedded default corpus: "
    moe_capacity_under_cp model=moe_tiny cp_size=2 model.compile=false model.moe_capacity_factor=1.0 "cp_size=2 with model.moe_capacity_factor=1.0: each cp rank would drop past a capacity of its part of the sequences, not of the whole; set model.moe_capacity_factor=null (dropless) or cp_size=1"
    # item 9: silently accepted
    weights_nan data.weights=[nan,1] +prefixes=good,good "must be >= 0 with a positive sum, all finite"
    weights_inf data.weights=[inf,1] +prefixes=good,good "must be >= 0 with a positive sum, all finite"
    warmup_negative optim.warmup_steps=-5 "optim.warmup_steps=-5 must be >= 0"
    clip_negative optim.clip_grad=-1 "optim.clip_grad=-1.0 must be >= 0"
    # item 5: corrupt data files
    ids_past_vocab +prefixes=big_ids "token ids 0..993, outside the model's vocabulary of 512"
    ids_past_vocab_v1 +prefixes=v1_big_ids "token ids 0..999, outside the model's vocabulary of 512"
    bin_edited +prefixes=flipped "SHA-256 does not match the one flipped.idx recorded"
    eod_99999 +prefixes=eod_99999 "eod_id=99999 is outside the model's vocabulary of 512"
    eod_not_at_ends +prefixes=eod_not_at_ends "document 0 does not end with eod_id="
    offsets_not_monotonic +prefixes=not_monotonic "document offsets are not increasing at document 1"
    # item 10: Hydra's own errors
    hydra_bad_float optim.beta1=abc "Value 'abc' of type 'str' could not be converted to Float"
    hydra_unknown_key trainer.bogus=1 "unknown key 'trainer.bogus'"
    hydra_unknown_preset model=nope "model=nope names no model preset (presets: bert_base"
    mistyped_preset model=gpt_tny "model=gpt_tny names no model preset; did you mean model=gpt_tiny?"
    internal_schema_preset model=schema "model=schema names no model preset"
    sweep_with_a_mistyped_preset -m model=gpt_tiny,llama_tny "model=llama_tny names no model preset; did you mean model=llama_tiny?"
    sweep_refused_job_stops_it_before_the_first -m tp_size=1,3 "config error: job #1 (tp_size=3) of the sweep: model.num_heads=4 is not divisible by tp_size=3"
    hydra_parse_error optim.lr=[1 "cannot parse the override 'optim.lr=[1': no viable"
    # found beyond the issue's list
    beta2_1 optim.beta2=1.0 "optim.beta2=1.0 must be in [0, 1)"
    weight_decay_negative optim.weight_decay=-0.1 "optim.weight_decay=-0.1 must be >= 0"
    eval_batches_negative trainer.eval_batches=-1 "trainer.eval_batches=-1 must be >= 0"
    eval_every_negative trainer.eval_every=-1 "trainer.eval_every=-1 must be >= 0"
    top_k_negative trainer.sample_top_k=-1 "trainer.sample_top_k=-1 must be >= 0"
    loss_scale_0 trainer.loss_scale_init=0 "trainer.loss_scale_init=0.0 must be > 0"
    split_nan "data.split='nan,1'" "data.split='nan,1' is invalid"
    split_four_parts "data.split='1,2,3,4'" "has more than 3 parts"
    lr_nan optim.lr=nan "optim.lr=nan must be in (0, 1000]"
    device_tpu trainer.device=tpu "trainer.device='tpu' is not one of auto, cuda, cpu"
    # issue 22 item 4: values no run can honour
    max_steps_past_int64 trainer.max_steps=99999999999999999999999 "trainer.max_steps=99999999999999999999999 must be in [1, 2**63-1]"
    layernorm_eps_negative model.layernorm_eps=-1 "model.layernorm_eps=-1.0 must be > 0 and finite"
    layernorm_eps_nan model.layernorm_eps=nan "model.layernorm_eps=nan must be > 0 and finite"
    lr_absurd optim.lr=1e30 "optim.lr=1e+30 must be in (0, 1000]"
    decay_steps_0 optim.decay_steps=0 "optim.decay_steps=0 must be >= 1"
    decay_steps_negative optim.decay_steps=-10 "optim.decay_steps=-10 must be >= 1"
    timeout_nan trainer.collective_timeout_s=nan "trainer.collective_timeout_s=nan must be >= 0 and finite"
    timeout_inf trainer.collective_timeout_s=inf "trainer.collective_timeout_s=inf must be >= 0 and finite"
    unknown_key_added +foo=1 "unknown key 'foo'"
    unknown_key_added_in_group +trainer.max_step=5 "unknown key 'trainer.max_step'; did you mean trainer.max_steps?"
    mistyped_key trainer.max_step=5 "unknown key 'trainer.max_step'; did you mean trainer.max_steps?"
    # item 7: run names that leave their folder
    name_escapes name=../../escaped_run "name='../../escaped_run' must be a plain name"
    name_empty "name=''" "name='' must be a plain name"
    # item 8: tracebacks
    run_dir_under_a_file hydra.run.dir={a_file}/run "cannot create the run directory"
    run_dir_is_a_file hydra.run.dir={a_file} "cannot create the run directory: "
    default_max_bytes_0 data.default_max_bytes=0 "data.default_max_bytes=0 must be >= 1"
    # item 9: late errors (inside a worker, or after the whole run)
    metrics_file_is_a_dir trainer.metrics_file={dir} "trainer.metrics_file="
    metrics_file_unwritable trainer.metrics_file={a_file}/m.json "cannot be written"
    data_seed_negative data.seed=-1 "data.seed=-1 must be in [0, 2**63-1]"
    seed_past_int64 trainer.seed=1267650600228229401496703205376 "trainer.seed=1267650600228229401496703205376 must be in [0, 2**63-1]"
    init_std_negative model.init_std=-0.02 "model.init_std=-0.02 must be >= 0 and finite"
    ffn_negative model.ffn_hidden_size=-4 "model.ffn_hidden_size=-4 must be >= 1"
    apex_missing optim.impl=apex "optim.impl=apex needs NVIDIA apex, which is not installed"
    apex_kernels_missing model.kernels=apex "model.kernels=apex needs NVIDIA apex, which is not installed"
    sample_prompt_empty "trainer.sample_prompt=''" "trainer.sample_prompt='' is empty"
    checkpoint_dir_under_a_file checkpoint.dir={a_file}/ck "is not writable"
    profile_steps_past_int64 trainer.profile_steps=[1,99999999999999999999] "trainer.profile_steps=[1, 99999999999999999999] must be a finite number within 64 bits"
    sample_past_positions trainer.sample_tokens=100000 "trainer.sample_tokens=100000 must be < model.max_positions=256"
"""
PRETRAIN = [(cid, overrides, fragment) for cid, *overrides, fragment in shell_cases(PRETRAIN_CASES)]


def _pretrain_argv(case: list[str], p: dict[str, str]) -> list[str]:
    prefixes = next((o.split("=", 1)[1] for o in case if o.startswith("+prefixes=")), "good")
    overrides = [o.format(**p) for o in case if not o.startswith("+prefixes=")]
    return _base(p, prefixes) + overrides


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _config_refusal(module: str, argv: list[str], monkeypatch, capsys) -> str:
    """The one ``config error:`` line (exit 2) of ``module`` run as ``python -m`` does,
    Hydra's parsing included, with ``argv``."""
    monkeypatch.setattr(sys, "argv", [f"{module.rsplit('.', 1)[-1]}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__")
    line = _one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and line.startswith("config error: "), line
    return line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "fragment"), [c[1:] for c in PRETRAIN], ids=[c[0] for c in PRETRAIN]
)
def test_pretrain_bad_input_is_one_config_error_line(
    inputs, overrides, fragment, monkeypatch, capsys
):
    if "needs wandb" in fragment and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here, so trainer.wandb_project is valid")
    if "needs NVIDIA apex" in fragment and importlib.util.find_spec("apex") is not None:
        pytest.skip("apex is installed here, so optim.impl=apex and model.kernels=apex are valid")
    monkeypatch.chdir(inputs["dir"])
    line = _config_refusal(
        "engine.pretrain", _pretrain_argv(overrides, inputs), monkeypatch, capsys
    )
    assert fragment in line, line
    # A refused run leaves nothing behind (issue 23): no run directory, no checkpoint folder.
    here = Path(inputs["dir"])
    litter = [n for n in ("hydra", "ck_run", "outputs", "checkpoints") if (here / n).exists()]
    assert not litter, litter


def test_refused_run_leaves_no_outputs_folder(inputs, monkeypatch, capsys, tmp_path):
    """Hydra's default run directory (outputs/DATE/TIME, made before the config is checked)
    is removed again when the run is refused (issue 23: it used to keep an empty log)."""
    monkeypatch.chdir(tmp_path)
    argv = [o for o in _pretrain_argv(["optim.beta1=2"], inputs) if not o.startswith("hydra.")]
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    assert exit_info.value.code == 2 and "optim.beta1=2.0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_default_corpus_cap_that_takes_no_text_is_one_line(tmp_path, monkeypatch, capsys):
    """``data.default_max_bytes`` below any non-empty stdlib file was a traceback from the
    tokenizer trainer ("empty corpus"), printed by Hydra after the cache lock was taken."""
    from engine.data.default_corpus import stdlib_sources

    # The stdlib here decides which line: its .py files of at most 1 byte are empty ones
    # (then no text at all), unless it has a 1-byte file (then one token, and the train
    # split's check refuses it). Either is one config line, before any rank starts.
    no_text = not any(size for _, size in stdlib_sources(1)[1])
    expected = "data.default_max_bytes=1: the .py files of " if no_text else "fewer than"
    argv = ["data.default_max_bytes=1", f"data.cache_dir={tmp_path}/cache", "model=gpt_tiny"]
    argv += ["trainer.device=cpu", f"hydra.run.dir={tmp_path}/run"]
    monkeypatch.chdir(tmp_path)
    line = _config_refusal("engine.pretrain", argv, monkeypatch, capsys)
    assert expected in line, line
    assert not no_text or line.endswith(
        "raise it (the default corpus is 4,000,000 bytes) or pass data.prefixes"
    ), line


def test_a_sweep_flag_typed_among_the_overrides_still_sweeps(inputs, monkeypatch, capsys):
    """``-m`` among the overrides (Hydra's parser wants it before them) starts the sweep:
    its first job, optim.lr=-1, is refused as a config error rather than the command line
    as "unrecognized arguments", before the sweep starts. A sweep over presets (model=gpt_tiny,gpt_tiny) names
    presets each, so the preset check lets it through to that job."""
    monkeypatch.chdir(inputs["dir"])
    argv = [o for o in _pretrain_argv([], inputs) if not o.startswith("hydra.")]
    argv = [a if a != "model=gpt_tiny" else "model=gpt_tiny,gpt_tiny" for a in argv]
    sweep_dir = f"hydra.sweep.dir={inputs['dir']}/sweep"
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *argv, sweep_dir, "-m", "optim.lr=-1,0.001"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    err = capsys.readouterr().err
    # refused before any job runs, naming the job (its swept values)
    assert exit_info.value.code == 2, err
    assert err.startswith("config error: job #0 (model=gpt_tiny optim.lr=-1) of the sweep: ")
    assert "optim.lr=-1.0 must be in (0, 1000]" in err and "job #1" not in err
    assert "unrecognized arguments" not in err


def test_hydras_own_flags_with_values_are_no_overrides(monkeypatch, capsys):
    """``--cfg job`` prints the composed config (Hydra's flag; before, "job" was taken for
    an override and refused as an unknown key), and a mistyped key after it is still one."""
    from engine.config_cli import unknown_key

    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--cfg", "job", "tp_size=1"])
    try:
        runpy.run_module("engine.pretrain", run_name="__main__")  # Hydra prints and returns
    except SystemExit as stop:
        assert stop.code in (0, None), capsys.readouterr().err
    captured = capsys.readouterr()
    assert "model:\n  arch: gpt\n" in captured.out and "tp_size: 1" in captured.out
    assert unknown_key(["-c", "job", "--package", "model", "model.hidden_size=8"]) is None
    assert unknown_key(["--cfg", "job", "tp_sze=1"]).startswith("unknown key 'tp_sze'")


def test_pretrain_help_lists_every_key_with_its_default_and_doc(monkeypatch, capsys):
    """--help: every key of the schema (engine/config.py's dataclasses) with the composed
    default and its doc; no Hydra ``schema`` options, no test hooks."""
    import dataclasses

    from engine.config import Config

    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    assert exit_info.value.code is None  # status 0
    out = capsys.readouterr().out
    sections = [
        f for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)
    ]
    keys = [f"{f.name}.{g.name}" for f in sections for g in dataclasses.fields(f.default_factory)]
    shown = [k for k in keys if k != "trainer.fail_at_step"]
    missing = [k for k in shown if not re.search(rf"^  {re.escape(k)}=.*  # \S", out, re.M)]
    assert not missing, missing
    assert "  model.vocab_size=8192  # real vocabulary" in out  # gpt_tiny's value, not the schema's
    assert "  trainer.max_steps=150  # optimizer steps" in out and "  tp_size=2  # " in out
    assert "schema" not in out and "fail_at_step" not in out and "run_dir" not in out
    for section in ("model:", "data:", "optim:", "trainer:", "checkpoint:", "run:"):
        assert re.search(rf"^{section}", out, re.M), section


def test_pretrain_device_cuda_without_a_gpu_is_one_line(inputs, monkeypatch, capsys):
    """trainer.device=cuda where no GPU is visible (made so on any machine) is refused
    before any worker starts."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(inputs["dir"])
    argv = _pretrain_argv(["trainer.device=cuda"], inputs)
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    line = _one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2
    assert line == (
        "config error: trainer.device=cuda, but no CUDA device is visible; "
        "pass trainer.device=cpu (or auto)"
    ), line


# apps.classify: (id, overrides ({key} = a path of the fixture), message fragment), exit 2
CLASSIFY = [
    ("unknown_key", ["trainer.bogus=1"], "unknown key 'trainer.bogus' (python -m apps.classify"),
    (
        "mistyped_key",
        ["trainer.epoch=3"],
        "unknown key 'trainer.epoch'; did you mean trainer.epochs?",
    ),
    ("lr_inf", ["trainer.lr=inf"], "trainer.lr=inf must be in (0, 1000]"),
    ("lr_absurd", ["trainer.lr=1e30"], "trainer.lr=1e+30 must be in (0, 1000]"),
    ("seed_negative", ["trainer.seed=-1"], "trainer.seed=-1 must be in [0, 2**63-1]"),
    ("momentum_nan", ["trainer.momentum=nan"], "trainer.momentum=nan must be in [0, 1)"),
    ("bucket_0", ["trainer.grad_bucket_mb=0"], "trainer.grad_bucket_mb=0.0 must be > 0"),
    (
        "subset_negative",  # one line: not also "exceeds the -5 training images"
        ["data.train_subset=-5"],
        "data.train_subset=-5 and data.test_subset=0 must be >= 0 (0: all)",
    ),
    (
        "epochs_past_int64",
        ["trainer.epochs=99999999999999999999999"],
        "trainer.epochs=99999999999999999999999 must be a finite number within 64 bits",
    ),
    ("metrics_file_is_a_dir", ["trainer.metrics_file={dir}"], "is a directory; give a file path"),
    ("run_dir_is_a_file", ["hydra.run.dir={a_file}"], "cannot create the run directory: "),
    ("hydra_bad_float", ["trainer.lr=abc"], "could not be converted to Float"),
]


@pytest.mark.parametrize(
    ("overrides", "fragment"), [c[1:] for c in CLASSIFY], ids=[c[0] for c in CLASSIFY]
)
def test_classify_bad_input_is_one_config_error_line(
    inputs, overrides, fragment, monkeypatch, capsys, tmp_path
):
    """Each refused before any rank starts (they used to be accepted, fail inside a rank,
    or print Hydra's several lines with exit 1). The data set is stood in for by empty
    files: nothing is read before the refusal."""
    from engine.data.fashion_mnist import FILES

    for stem in FILES.values():
        (tmp_path / stem).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    argv = [f"data.dir={tmp_path}", *(o.format(**inputs) for o in overrides)]
    assert fragment in _config_refusal("apps.classify", argv, monkeypatch, capsys)


# One case a line: id, tool, exit status, argv ({key} = a path of the fixture), "message
# fragment"
TOOLS_CASES = """
    convert_tp_0 checkpoint 2 convert {ck} --tp-size 0 --dp-size 1 --out {dir}/o1 "--tp-size 0 and --dp-size 1 must be >= 1"
    export_dcp_out_under_a_file checkpoint 2 export-dcp {ck} {a_file}/dcp "a_file/dcp cannot be written (Not a directory)"
    export_dcp_no_out checkpoint 2 export-dcp {ck} "export-dcp: OUT is missing: give it last or as --out OUT"
    export_dcp_two_outs checkpoint 2 export-dcp {ck} {dir}/x --out {dir}/y "export-dcp: OUT is given twice"
    convert_out_after_a_stray checkpoint 2 convert {ck} --tp-size 1 --dp-size 1 {dir}/a {dir}/b "unrecognized arguments:"
    generate_named_tokenizer_missing generate 2 --ckpt {ck} --prompt hi --tokenizer {dir}/none.json "none.json does not exist; give a tokenizer.json file"
    generate_named_tokenizer_a_directory generate 2 --ckpt {ck} --prompt hi --tokenizer {dir}/text "text is a directory; give a tokenizer.json file"
    verify_hf_dir_with_tiny_model_flags verify_equivalence 2 --hf-dir {dir} --model llama --layers 7 "--model --layers describe the tiny model; an --hf-dir directory has its own (drop --model --layers)"
    verify_ep_not_dividing_dp verify_equivalence 2 --ep-size 2 --dp-size 1 "--ep-size 2 must divide --dp-size 1 and --experts 4"
    verify_layers_not_dividing_stages verify_equivalence 2 --model bert --pp-size 2 --schedule zbv "--layers 2 is not divisible by the 4 pipeline stages (--pp-size 2 × --virtual-stages 2): give a multiple of 4 (--layers 4)"
    verify_heads_not_dividing_hidden verify_equivalence 2 --heads 5 "--hidden 48 is not divisible by --heads 5"
    quantize_report_no_checkpoint quantize_report 2 --ckpt {dir}/none "none does not exist: give a checkpoint root"
    convert_out_is_file checkpoint 2 convert {ck} --tp-size 1 --dp-size 1 --out {a_file} "is a file; give a checkpoint directory"
    convert_out_under_a_file checkpoint 2 convert {ck} --tp-size 1 --dp-size 1 --out {a_file}/c "a_file/c cannot be written (Not a directory); give a directory that can be written"
    convert_huge_shape checkpoint 2 convert {ck_huge} --tp-size 1 --dp-size 1 --out {dir}/o2 "model/embedding.position of shape [1000000, 1000000] needs 4000000000000 bytes"
    export_huge_shape checkpoint 2 export-model {ck_huge} --out {dir}/o3 "needs 4000000000000 bytes, more than the checkpoint's files hold"
    convert_wrong_shape checkpoint 2 convert {ck_shape} --tp-size 1 --dp-size 1 --out {dir}/o4 "model/embedding.position has shape [64, 33], the model_config's model [256, 32]"
    export_out_is_file checkpoint 2 export-model {ck} --out {a_file} "a_file is a file; give a new directory"
    export_out_holds_files checkpoint 2 export-model {ck} --out {dir}/text "text exists and holds other files (00.txt, 01.txt, 02.txt)"
    hf_import_out_is_file convert_hf 2 import --hf-dir {hf_garbage} --out {a_file} "a_file is a file; give a new directory"
    hf_garbage_weights convert_hf 2 import --hf-dir {hf_garbage} --out {dir}/o5 "model.safetensors is not a readable safetensors file"
    hf_parent_path convert_hf 2 import --hf-dir {hf_parent} --out {dir}/o6 "names shard '../secret.safetensors': only a .safetensors file name inside"
    hf_absolute_path convert_hf 2 import --hf-dir {hf_absolute} --out {dir}/o7 "x.safetensors': only a .safetensors file name inside that directory"
    verify_microbatches_0 verify_equivalence 2 --pp-size 2 --microbatches 0 "argument --microbatches: 0 must be >= 1"
    verify_hf_no_weights verify_equivalence 2 --hf-dir {hf_no_weights} --tp-size 1 "has no model.safetensors"
    bench_unknown_preset bench_train 2 --preset nonexistent "unknown model preset 'nonexistent'"
    bench_tp_0 bench_train 2 --tp 0 "argument --tp: 0 must be >= 1"
    bench_experts_on_a_dense_preset bench_train 2 --preset gpt_tiny --experts 4 "--experts: --preset gpt_tiny has no experts (model.mlp=dense); pick a preset with mlp: moe, such as moe_tiny"
    bench_eager_without_compile bench_train 2 --also-eager "--also-eager compares against --compile: give --compile too"
    bench_pipeline_pp_1 bench_pipeline 2 --pp 1 "--pp 1 has no pipeline to time: give --pp 2 or more"
    bench_pipeline_layers_not_dividing bench_pipeline 2 --pp 3 "--schedules 1f1b: --layers 8 is not divisible by the 3 pipeline stages (--pp 3 × virtual_stages=1): give a multiple of 3 (--layers 9)"
    bench_checkpoint_past_the_memory bench_checkpoint 2 --preset llama_70b "--preset llama_70b: 70.55 B parameters need about 1051.3 GiB for weights and AdamW state, and this machine has"
    bench_train_past_the_memory bench_train 2 --preset llama_70b --no-reference "--preset llama_70b: 70.55 B parameters need about"
    graph_breaks_past_the_memory count_graph_breaks 2 --preset llama_70b "--preset llama_70b: 70.55 B parameters need about"
    bench_dp_without_a_launcher bench_train 2 --dp 2 "error: --tp 1 × --dp 2 = 2 ranks, and 1 process run this: start it as torchrun --nproc-per-node 2 tools/bench_train.py"
    bench_micro_batch_0 bench_train 2 --micro-batch 0 "argument --micro-batch: 0 must be >= 1"
    bench_seq_0 bench_train 2 --seq 0 "argument --seq: 0 must be >= 1"
    bench_threads_0 bench_train 2 --threads 0 "argument --threads: 0 must be >= 1"
    bench_kernels_tokens_0 bench_kernels 2 --tokens 0 "argument --tokens: 0 must be >= 1"
    # issue 22: a tool's bounded job it cannot finish, its own input overwritten, tracebacks
    generate_past_positions generate 2 --ckpt {ck} --tokenizer {tokenizer} --prompt "def f" --max-new-tokens 5000 "--max-new-tokens 5000 after a prompt of "
    generate_corrupt_tokenizer generate 2 --ckpt {ck} --tokenizer {a_file} --prompt x "a_file is not a readable tokenizer.json"
    generate_hf_no_weights generate 2 --hf-dir {hf_no_weights} --tokenizer {tokenizer} --prompt x "has no model.safetensors"
    convert_onto_its_source checkpoint 2 convert {ck} --tp-size 2 --dp-size 1 --out {ck} "is inside the source run's checkpoint root"
    bench_generate_heads_3 bench_generate 2 --heads 3 "error: --hidden 128 is not divisible by --heads 3"
    bench_generate_prompt_negative bench_generate 2 --prompt-len -5 "argument --prompt-len: -5 must be >= 1"
    bench_generate_batches_0 bench_generate 2 --batches 0 "argument --batches: 0 must be >= 1"
    calibrate_out_under_a_file calibrate 2 --quick --out {a_file}/c.yaml "cannot be written"
    plan_gpus_0 plan 2 predict --model gpt_tiny --global-batch 8 --gpus 0 "argument --gpus: 0 must be >= 1"
    plan_gpus_negative plan 2 search --model gpt_tiny --global-batch 8 --gpus -1 "argument --gpus: -1 must be >= 1"
    plan_gpus_past_any_cluster plan 2 search --model gpt_tiny --global-batch 8 --gpus 99999999999 "argument --gpus: 99999999999 must be <= 1048576"
    scaling_study_out_under_a_file scaling_study 2 --out {a_file}/study "cannot be written"
    scaling_study_unknown_override scaling_study 2 --out {dir}/o10 bogus.key=3 "unknown key 'bogus.key'"
    scaling_study_bad_override_value scaling_study 2 --out {dir}/o11 optim.lr=abc "Value 'abc' of type 'str' could not be converted to Float full_key: optim.lr"
    scaling_study_grid_key_override scaling_study 2 --out {dir}/o17 tp_size=2 "tp_size=2 among the overrides would run every point at it while the study labels each by --tp: drop it and give --tp 2 instead"
    scaling_study_own_key_override scaling_study 2 --out {dir}/o18 trainer.metrics_file={dir}/m.json "m.json among the overrides: the study sets trainer.metrics_file for each point itself"
    scaling_study_resume_nothing scaling_study 2 --out {dir}/o12 --resume "o12 does not exist (no study to continue); fix --out or drop --resume"
    scaling_study_no_point_runs scaling_study 2 --out {dir}/o13 --model gpt_tiny --dp 3 --no-links "no point of the grid can run: n1x3-tp1-dp3-mb4-gb16: --global-batch 16 is not a multiple of --micro-batch × --dp = 4 × 3 = 12"
    scaling_study_no_point_fits_the_nodes scaling_study 2 --out {dir}/o14 --dp 1 --nodes 3 "no point of the grid can run: tp=1 dp=1 (1 rank) does not split evenly over 3 nodes"
    scaling_study_cluster_not_yaml scaling_study 2 --out {dir}/o16 --cluster {bad_yaml} "bad.yaml is not a readable YAML file (while parsing a flow mapping)"
    scaling_study_mistyped_model scaling_study 2 --out {dir}/o15 --model gpt_tny "--model gpt_tny names no model preset; did you mean --model gpt_tiny?"
    preprocess_workers_0 preprocess_data 2 --input {dir}/text/00.txt --output-prefix {dir}/o8 --vocab-size 300 --workers 0 "argument --workers: 0 must be >= 1"
    preprocess_workers_negative preprocess_data 2 --input {dir}/text/00.txt --output-prefix {dir}/o9 --vocab-size 300 --workers -3 "argument --workers: -3 must be >= 1"
    preprocess_vocab_tiny preprocess_data 2 --input {dir}/text/00.txt --output-prefix {dir}/o10 --vocab-size 10 "argument --vocab-size: 10 is too small: a byte-level BPE needs at least 261 ids"
    preprocess_prefix_in_proc preprocess_data 2 --input {dir}/text/00.txt --output-prefix /proc/corpus --vocab-size 300 "cannot write into /proc ("
    calibrate_tp_0 calibrate 2 --quick --tp 0 --out {dir}/c2.yaml "argument --tp: 0 must be >= 1"
    calibrate_tp_not_int calibrate 2 --quick --tp a,b --out {dir}/c3.yaml "argument --tp: 'a' is not an integer (in the comma list 'a,b')"
    validate_csv_empty validate_perfmodel 2 scaling --csv {empty_file} --cluster cpu_2core "empty_file has no usable rows (the file is empty); give the results.csv of tools/scaling_study.py, with the columns tp_size, dp_size, micro_batch, global_batch, step_time_s"
    validate_csv_not_a_csv validate_perfmodel 2 scaling --csv {a_file} --cluster cpu_2core "a_file has no usable rows (no header row); give the results.csv of tools/scaling_study.py, with the columns"
    validate_csv_missing validate_perfmodel 2 scaling --csv {dir}/missing.csv --cluster cpu_2core "missing.csv does not exist; give the results.csv of a scaling study"
    validate_reuse_missing validate_perfmodel 2 machine --cluster cpu_2core --reuse {dir}/none.json "none.json: no such file (give files --save wrote)"
    validate_reuse_not_json validate_perfmodel 2 machine --cluster cpu_2core --reuse {a_file} "a_file: not a JSON file --save wrote"
    validate_points_past_the_last validate_perfmodel 2 machine --cluster cpu_2core --points 99 "argument --points: '99' is not a point index: give a comma list of 0..12"
    plan_emulated_without_compute plan 2 predict --model gpt_tiny --global-batch 8 --gpus 2 --cluster emulated_1gbit "emulated_1gbit.yaml: intra_node.bandwidth_GBps, intra_node.latency_us and 4 more are null (measured per study): this spec describes links over another's compute; fill the rest from a calibrated spec with --compute-from (e.g. --compute-from cpu_2core)"
    plan_compute_from_a_whole_spec plan 2 predict --model gpt_tiny --global-batch 8 --gpus 2 --cluster dgx_h100 --compute-from cpu_2core "dgx_h100.yaml: --compute-from cpu_2core fills the figures a spec leaves null, and this one leaves none: drop --compute-from"
    validate_emulated_without_compute validate_perfmodel 2 scaling --csv {empty_file} --cluster emulated_100mbit "emulated_100mbit.yaml: intra_node.bandwidth_GBps, intra_node.latency_us and 4 more are null"
    plan_cluster_is_a_dir plan 2 predict --model gpt_125m --global-batch 8 --gpus 2 --cluster {empty_dir} "empty_dir' is a directory, not a cluster spec; give a cluster YAML file"
    # the bench tools: refused before any worker starts or the benchmark runs
    bench_dp_memory_unknown_preset bench_dp_memory 2 --model nope "--model nope: unknown model preset 'nope'"
    bench_generate_device_tpu bench_generate 2 --batches 1 --new-tokens 2 --device tpu "argument --device: invalid choice: 'tpu'"
    graph_breaks_tp_3 count_graph_breaks 2 --preset gpt_tiny --tp 3 "error: world size 1 is not divisible by --tp 3; launch a multiple of 3 processes or choose a --tp dividing 1"
    graph_breaks_ep_dense count_graph_breaks 2 --preset gpt_tiny --ep 2 "--ep 2 splits the experts of an MoE preset; --preset gpt_tiny has none"
    graph_breaks_heads_3 count_graph_breaks 2 --preset gpt_tiny --heads 3 "error: --hidden 128 is not divisible by --heads 3"
    bench_serve_json_unwritable bench_serve 2 --skip-http --json /proc/x/s.json "argument --json: /proc/x/s.json: its folder /proc/x does not exist"
    bench_serve_json_is_a_dir bench_serve 2 --skip-http --json {dir} "is a directory; give a file path"
    bench_train_out_unwritable bench_train 2 --preset gpt_tiny --out /proc/x/o.json --no-reference "argument --out: /proc/x/o.json: its folder /proc/x does not exist"
    bench_train_out_under_a_file bench_train 2 --preset gpt_tiny --out {a_file}/o.json --no-reference "a_file is not a directory"
    bench_moe_json_unwritable bench_moe 2 --json /proc/x/m.json --repeats 1 --warmup 0 --only layer "argument --json: /proc/x/m.json: its folder /proc/x does not exist"
    bench_checkpoint_out_unwritable bench_checkpoint 2 --preset gpt_tiny --rounds 1 --out /proc/x/o.json "argument --out: /proc/x/o.json: its folder /proc/x does not exist"
    bench_kernels_out_unwritable bench_kernels 2 --cpu --smoke --out /proc/x/k.json "argument --out: /proc/x/k.json: /proc/x cannot be written"
    bench_checkpoint_dir_is_a_file bench_checkpoint 2 --preset gpt_tiny --rounds 1 --dir {a_file} "a_file is a file; give a directory"
    bench_checkpoint_dir_unwritable bench_checkpoint 2 --preset gpt_tiny --rounds 1 --dir /proc/x/d "argument --dir: /proc/x/d: /proc/x cannot be written"
    bench_serve_ckpt_missing bench_serve 2 --ckpt {dir}/no_such_ckpt --skip-http "no_such_ckpt does not exist: give a checkpoint root"
    bench_serve_ckpt_a_file bench_serve 2 --ckpt {a_file} --skip-http "a_file is neither a checkpoint step directory nor a checkpoint root"
"""
TOOLS = [
    (cid, tool, argv, int(status), fragment)
    for cid, tool, status, *argv, fragment in shell_cases(TOOLS_CASES)
]


def _tool(name: str):
    module = f"bad_input_tool_{name}"
    if module not in sys.modules:  # registered first: dataclasses look their module up there
        spec = importlib.util.spec_from_file_location(module, ROOT / "tools" / f"{name}.py")
        sys.modules[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module])
    return sys.modules[module]


@pytest.mark.parametrize(
    ("tool", "argv", "status", "fragment"), [c[1:] for c in TOOLS], ids=[c[0] for c in TOOLS]
)
def test_tool_bad_input_is_one_error_line(inputs, tool, argv, status, fragment, capsys):
    try:
        code = _tool(tool).main([a.format(**inputs) for a in argv])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    line = _one_line(capsys.readouterr().err)
    assert code == status and fragment in line, (code, line)
    assert not list(Path(inputs["dir"]).glob("o[0-9]*")), "a refused command wrote output"
    assert Path(inputs["a_file"]).read_text() == "not a directory"
    assert len(list((Path(inputs["dir"]) / "text").glob("*.txt"))) == 20


def test_bench_generate_device_cuda_without_a_gpu_is_one_line(monkeypatch, capsys):
    """--device cuda where no GPU is visible (made so on any machine) is refused while
    parsing; it was torch's RuntimeError from building the model."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        _tool("bench_generate").main(["--batches", "1", "--new-tokens", "2", "--device", "cuda"])
    line = _one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2, line
    assert "--device cuda, but no CUDA device is visible; pass --device cpu" in line, line


# What only a real process shows: a validation error and a Hydra error of engine.pretrain,
# an error raised in a tool and one found by a tool's argument parser.
SUBPROCESS = [
    "beta1_2",
    "hydra_bad_float",
    "convert_huge_shape",
    "bench_micro_batch_0",
    "run_dir_under_a_file",
    "generate_corrupt_tokenizer",
]


def _command(case_id: str, p: dict[str, str]) -> tuple[list[str], str]:
    for cid, overrides, fragment in PRETRAIN:
        if cid == case_id:
            return [
                sys.executable,
                "-m",
                "engine.pretrain",
                *_pretrain_argv(overrides, p),
            ], fragment
    cid, tool, argv, _, fragment = next(c for c in TOOLS if c[0] == case_id)
    script = str(ROOT / "tools" / f"{tool}.py")
    return [sys.executable, script, *(a.format(**p) for a in argv)], fragment


@pytest.mark.slow
def test_representative_bad_inputs_as_real_processes(inputs, tmp_path):
    env = env_with_repo()
    procs = {}
    for case_id in SUBPROCESS:  # started together: most of each is importing torch
        command, fragment = _command(case_id, inputs)
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        procs[case_id] = (proc, fragment)
    for case_id, (proc, fragment) in procs.items():
        _, err = proc.communicate(timeout=300)
        line = _one_line(err)
        assert (proc.returncode, fragment in line) == (2, True), (case_id, proc.returncode, line)


def test_good_inputs_pass_the_same_checks(inputs, monkeypatch):
    """The control: the base run and the undamaged files pass, so each failure above is its
    bad input's doing. The index's recorded range and checksum match the .bin's bytes."""
    import hashlib

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from engine.pretrain import prepare

    good = IndexedDataset(inputs["good"])
    tokens = np.fromfile(f"{inputs['good']}.bin", dtype=np.uint16)
    assert good.token_range == (int(tokens.min()), int(tokens.max()))
    assert good.bin_sha256 == hashlib.sha256(tokens.tobytes()).hexdigest()
    good.verify(512)
    monkeypatch.chdir(inputs["dir"])
    overrides = [o for o in _base(inputs) if not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=overrides))
    assert prepare(cfg).data.prefixes == [inputs["good"]]


@pytest.mark.slow
def test_a_refused_launch_of_several_ranks_is_one_line(inputs, tmp_path, monkeypatch, capsys):
    """Two ranks started by environment (as srun, mpirun or torchrun start them), sharing
    one run directory, each refusing the layout: each exits 2, and the node's first rank
    (LOCAL_RANK 0) prints the one line (every rank printed it: torchrun --nproc-per-node 3
    showed three). A rank used to remove the refused run's directory while another was
    still opening its log there, and that rank's refusal became a Hydra traceback. So a
    rank of several leaves the shared run directory where it is (checked first in this
    process, where the race cannot decide it). Two ranks are enough for the race (one
    removing, one opening); each more would only add a process start."""
    mine = ("hydra.run.dir=", "checkpoint.dir=", "tp_size=", "dp_size=")
    argv = [a for a in _base(inputs) if not a.startswith(mine)]
    argv += [
        f"hydra.run.dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "tp_size=2",
        "dp_size=4",  # 8 ranks asked, 2 started
    ]
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    assert exit_info.value.code == 2, capsys.readouterr().err
    assert capsys.readouterr().err == ""  # local rank 1: its node's rank 0 says why
    assert (tmp_path / "run").is_dir()  # the other ranks' run directory stays
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key)

    env = env_with_repo() | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "engine.pretrain", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=tmp_path,
        )
        for rank in range(2)
    ]
    errs = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (rank, proc.returncode, err)
        errs.append(err)
    assert "does not equal the world size 2" in _one_line(errs[0]) and errs[1] == "", errs
    assert not (tmp_path / "ck").exists()  # no checkpoint folder; the run folder may stay


# issue 39 item 4: a FIFO or a directory where a data file belongs. Each was blamed on the
# run directory (IndexedDataset's FileNotFoundError reached Hydra's run-directory handler);
# a FIFO tokenizer was read for ever.
NOT_FILES = [
    (
        "bin_fifo",
        "data.prefixes=[{x}]",
        "x.bin",
        "fifo",
        "data.prefixes: {x}.bin is not a regular file (a FIFO)",
    ),
    ("idx_dir", "data.prefixes=[{x}]", "x.idx", "dir", "data.prefixes: {x}.idx is a directory"),
    ("tokenizer_dir", "data.tokenizer={x}", "x", "dir", "data.tokenizer: {x} is a directory"),
]


def _not_a_file(inputs, tmp_path: Path, name: str, kind: str) -> str:
    """The good pair copied to ``tmp_path/x`` with ``name`` there made a FIFO or a folder."""
    for ext in (".bin", ".idx"):
        shutil.copy(inputs["good"] + ext, tmp_path / f"x{ext}")
    (tmp_path / name).unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(tmp_path / name)
    else:
        (tmp_path / name).mkdir()
    return str(tmp_path / "x")


@pytest.mark.parametrize(
    ("override", "name", "kind", "message"),
    [c[1:] for c in NOT_FILES],
    ids=[c[0] for c in NOT_FILES],
)
def test_pretrain_refuses_a_fifo_or_directory_as_data_as_such(
    inputs, tmp_path, monkeypatch, capsys, override, name, kind, message
):
    x = _not_a_file(inputs, tmp_path, name, kind)
    monkeypatch.chdir(tmp_path)
    key = override.split("=")[0] + "="
    argv = [a for a in _base(inputs) if not a.startswith((key, "hydra.run.dir="))]
    argv += [override.format(x=x), f"hydra.run.dir={tmp_path}/run"]
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("engine.pretrain", run_name="__main__")
    line = _one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and line == f"config error: {message.format(x=x)}", line


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.slow
def test_pretrain_refuses_a_fifo_tokenizer_without_reading_it(inputs, tmp_path, named):
    """In a real process: before the fix it waited for a writer for ever (the timeout).
    Named (data.tokenizer=) or the default beside the data (PREFIX.tokenizer.json)."""
    drop = ("data.tokenizer=", "hydra.run.dir=", "data.prefixes=")
    argv = [a for a in _base(inputs) if not a.startswith(drop)]
    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(inputs["good"] + suffix, f"{prefix}{suffix}")
    tokenizer = tmp_path / "tok.json" if named else tmp_path / "corpus.tokenizer.json"
    os.mkfifo(tokenizer)
    argv += [f"data.prefixes=[{prefix}]", f"hydra.run.dir={tmp_path}/run"]
    argv += [f"data.tokenizer={tokenizer}"] if named else []
    done = run_pretrain(argv, tmp_path, 300)
    line = _one_line(done.stderr)
    assert done.returncode == 2, done.stderr
    assert line.startswith("config error: data.tokenizer: ") and line.endswith(
        f"{tokenizer} is not a regular file (a FIFO)"
        + ("" if named else " (pass data.tokenizer=PATH)")
    ), line


# issue 39 (items 9 and 11): values that made every step NaN, and keys read as unset or
# ignored. Each is refused by the launching process's check (``prepare``), one line, exit 2.
SILENT_CASES = """
    rope_theta_0 model.rope_theta=0 "model.rope_theta=0.0 must be > 0 and finite"
    rope_theta_negative model.rope_theta=-1e4 "model.rope_theta=-10000.0 must be > 0"
    rope_theta_nan model.rope_theta=nan "model.rope_theta=nan must be > 0 and finite"
    rope_factor_0 model.rope_scaling=llama3 model.rope_scaling_factor=0 "model.rope_scaling_factor=0.0 must be > 0 and finite under model.rope_scaling=llama3"
    rope_factor_negative model.rope_scaling=llama3 model.rope_scaling_factor=-8 "model.rope_scaling_factor=-8.0 must be > 0"
    rope_factor_nan model.rope_scaling=llama3 model.rope_scaling_factor=nan "model.rope_scaling_factor=nan must be > 0"
    rope_freq_factors_equal model.rope_scaling=llama3 model.rope_low_freq_factor=4 "model.rope_low_freq_factor=4.0 and model.rope_high_freq_factor=4.0 must be finite with 0 < low < high"
    init_std_0 model.init_std=0 "model.init_std=0.0 starts every weight at zero"
    num_kv_heads_0 model.num_kv_heads=0 "model.num_kv_heads=0 must be >= 1 (or null"
    interleaved_at_pp_1 pipeline.schedule=interleaved_1f1b pp_size=1 "pipeline.schedule=interleaved_1f1b would be ignored at pp_size=1 (no pipeline)"
    virtual_stages_at_pp_1 pipeline.virtual_stages=2 "pipeline.virtual_stages=2 would be ignored at pp_size=1"
    layers_per_stage_at_pp_1 pipeline.layers_per_stage=[1,1] "pipeline.layers_per_stage=[1, 1] would be ignored at pp_size=1"
    schedule_unknown_at_pp_1 pipeline.schedule=zb "pipeline.schedule='zb' is not one of gpipe, 1f1b, interleaved_1f1b"
    max_steps_past_step_dirs trainer.max_steps=100000000 "trainer.max_steps=100000000 is past the last step a checkpoint directory can name (99999999, 8 digits)"
    profile_steps_negative trainer.profile_steps=[-1,2] "trainer.profile_steps=[-1, 2] must be >= 0"
    # the adversarial pass: one bad value, several lines
    min_lr_nan optim.min_lr=nan "optim.min_lr=nan in [0, lr]"
    max_positions_0 model.max_positions=0 "model.max_positions=0 must be >= 1"
    # keys that another key's setting leaves unread: refused, as the pipeline keys at pp 1
    rope_theta_learned model.rope_theta=500 "model.rope_theta=500.0 would be ignored with model.position_embedding=learned: set model.position_embedding=rotary, or leave it unset"
    rope_factor_unscaled model.position_embedding=rotary model.rope_scaling_factor=4 "model.rope_scaling_factor=4.0 would be ignored with model.rope_scaling=none: set model.rope_scaling=llama3, or leave it unset"
    moe_keys_dense model.moe_num_experts=4 model.moe_top_k=1 "model.moe_num_experts=4 and model.moe_top_k=1 would be ignored with model.mlp=dense (no experts): set model.mlp=moe, or leave them unset"
    token_types_gpt model.num_token_types=3 "model.num_token_types=3 would be ignored by model.arch=gpt (BERT alone embeds token types)"
    full_attention_no_window model.full_attention_every=2 "model.full_attention_every=2 would be ignored without model.sliding_window"
    backend_not_compiled model.compile=false model.compile_backend=aot_eager "model.compile_backend=aot_eager would be ignored with model.compile=false"
    loss_scale_fp32 trainer.precision=fp32 trainer.loss_scale_init=1024 "trainer.loss_scale_init=1024.0 would be ignored at trainer.precision=fp32 (loss scaling is fp16's)"
    muon_keys_adamw optim.muon_ns_steps=3 "optim.muon_ns_steps=3 would be ignored with optim.algorithm=adamw: set optim=muon, or leave it unset"
"""
SILENT = [(cid, overrides, fragment) for cid, *overrides, fragment in shell_cases(SILENT_CASES)]


def _prepare(inputs, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from engine.pretrain import prepare

    base = [o for o in _base(inputs) if not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return prepare(OmegaConf.to_object(compose("config", overrides=base + overrides)))


@pytest.mark.parametrize(
    ("overrides", "fragment"), [c[1:] for c in SILENT], ids=[c[0] for c in SILENT]
)
def test_silently_accepted_values_are_refused(inputs, overrides, fragment, monkeypatch, capsys):
    monkeypatch.chdir(inputs["dir"])
    with pytest.raises(SystemExit) as exit_info:
        _prepare(inputs, overrides)
    line = _one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and line.startswith("config error: "), line
    assert fragment in line, line


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.num_kv_heads=null"],  # unset: one KV head per query head
        ["model.rope_scaling_factor=8"],  # unread without llama3 scaling, but the default
        ["model.sliding_window=8", "model.full_attention_every=2"],  # read with a window
        ["optim=muon", "optim.muon_ns_steps=3"],  # read by Muon
        ["model.compile=false"],  # compile_backend at its default
        ["pipeline.schedule=1f1b", "pipeline.virtual_stages=1"],  # the defaults, at pp 1
        ["trainer.max_steps=100000000", "checkpoint.every=0"],  # no step directories
        ["trainer.max_steps=99999999"],
        ["trainer.profile_steps=[0,2]"],
    ],
)
def test_the_limits_of_the_new_rules_pass(inputs, overrides, monkeypatch):
    monkeypatch.chdir(inputs["dir"])
    assert _prepare(inputs, overrides).trainer.max_steps >= 1


def test_a_sample_setting_on_an_encoder_is_refused_and_no_sample_is_not():
    """BERT writes no sample after training: a sample key it would ignore is one line, and
    trainer.sample_tokens=0 (what experiment=bert_tiny_stdlib sets) is not a problem."""
    from engine.config import parallel_dims, validate
    from tests.test_engine import compose_config

    def problems(*overrides):
        cfg = compose_config("model=bert_tiny", "tp_size=1", "dp_size=1", *overrides)
        return [p for p in validate(cfg, parallel_dims(cfg, None)) if "sample" in p]

    assert problems("trainer.sample_prompt=abc", "trainer.sample_top_k=5") == [
        "trainer.sample_prompt=abc and trainer.sample_top_k=5 would be ignored by "
        "model.arch=bert (decoders alone write a sample): leave them unset, or "
        "trainer.sample_tokens=0"
    ]
    assert problems("trainer.sample_temperature=0") == [  # one line, not a range line too
        "trainer.sample_temperature=0.0 would be ignored by model.arch=bert (decoders alone "
        "write a sample): leave it unset, or trainer.sample_tokens=0"
    ]
    assert problems("trainer.sample_tokens=0") == []
    assert problems() == []  # the defaults, which a BERT run leaves alone


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("MASTER_PORT", "abc", "MASTER_PORT='abc' is not an integer"),
        ("MASTER_PORT", "70000", "MASTER_PORT=70000 is not a TCP port (0 .. 65535)"),
        ("RANK", "x", "RANK='x' is not an integer"),
        ("OMP_NUM_THREADS", "0", None),
        ("OMP_NUM_THREADS", "abc", None),
    ],
)
def test_a_launcher_variable_that_is_no_number_is_one_line(
    inputs, name, value, why, monkeypatch, capsys
):
    """MASTER_PORT=abc (or 70000, past a TCP port's 16 bits) was a ValueError traceback
    from the run directory's naming (pretrain) or from a rank (generate, serve, the
    benches); now pretrain, classify, serve and every tool say it in one line, exit 2."""
    import apps.serve
    from engine.tool_args import run_tool

    monkeypatch.setenv(name, value)
    if name == "RANK":
        monkeypatch.setenv("WORLD_SIZE", "2")
    line = f"environment variable {why}: set it to what the launcher means, or unset it"
    if name == "OMP_NUM_THREADS":  # libgomp warns and runs as if unset, while meshtron's
        # core share stood back for it: 4 ranks × all cores, several-fold slower on CPU
        line = (
            f"environment variable OMP_NUM_THREADS={value!r} is not a thread count (a whole "
            "number >= 1), and OpenMP would ignore it: set it to the threads each rank runs, "
            "or unset it (each CPU rank then gets its share of the cores)"
        )
    monkeypatch.chdir(inputs["dir"])
    refused = _config_refusal("engine.pretrain", _pretrain_argv([], inputs), monkeypatch, capsys)
    assert refused == f"config error: {line}"
    assert _config_refusal("apps.classify", [], monkeypatch, capsys) == f"config error: {line}"
    monkeypatch.setattr(sys, "argv", ["generate.py"])
    with pytest.raises(SystemExit) as stop:
        run_tool(lambda: pytest.fail("the tool ran"))
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"generate.py: error: {line}\n"
    assert apps.serve.main(["--ckpt", inputs["ck"], "--port", "0"]) == 2
    assert capsys.readouterr().err == f"serve: {line}\n"
