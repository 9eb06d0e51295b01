"""One-pass hashed safetensors I/O (engine/checkpoint/tensorfile.py) against the real tools.

The files must be what the ``safetensors`` package reads and writes, and the digests what
``blake3`` / ``hashlib`` give for the whole file's bytes; every comparison is exact
(bytes are copied, never computed on).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from blake3 import blake3
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint import full_optimizer_state, load_checkpoint, save_checkpoint
from engine.checkpoint.storage import CheckpointError, read_index, sha256_file, write_index
from engine.checkpoint.tensorfile import TensorFileError, read_tensors, write_tensors
from engine.models import build_model, preset
from tests.fresh_buffers import FreshBuffers


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    return {
        "f32": torch.randn(7, 3, generator=g),
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i64": torch.arange(9).view(3, 3),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "view": base[1:4],  # shares storage with the next
        "strided": base.t(),  # non-contiguous
    }


def test_written_file_is_safetensors_and_hash_is_of_its_bytes(tmp_path):
    path = tmp_path / "a.safetensors"
    tensors = _tensors()
    digest = write_tensors(path, tensors, metadata={"format": "test"})
    assert digest == blake3(path.read_bytes()).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "test"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name


def test_reads_what_safetensors_wrote_with_the_hash_of_its_bytes(tmp_path):
    path = tmp_path / "b.safetensors"
    tensors = {k: v.contiguous().clone() for k, v in _tensors().items()}
    save_file(tensors, str(path), metadata={"format": "x"})
    for algo, reference in (("blake3", blake3), ("sha256", hashlib.sha256)):
        read, digest = read_tensors(path, algo)
        assert digest == reference(path.read_bytes()).hexdigest()
        assert read.keys() == tensors.keys()
        for name, t in tensors.items():
            assert read[name].dtype == t.dtype and torch.equal(read[name], t), name


def test_no_copies_on_save_and_one_tensor_per_tensor_on_load(tmp_path):
    """Saving a contiguous tensor allocates nothing of its size (its memory is written);
    loading allocates exactly its destination, once (no zeroed buffer, no copy)."""
    big = torch.randn(1000, 100, device="cpu")
    path = tmp_path / "c.safetensors"
    with FreshBuffers(big.numel()) as saving:
        write_tensors(path, {"big": big}, metadata={})
    with FreshBuffers(big.numel()) as loading:
        read, _ = read_tensors(path, "blake3")
    assert saving.ops == [], saving.ops
    assert loading.ops == ["empty"], loading.ops
    assert torch.equal(read["big"], big)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated inside the data
        lambda b: (10**12).to_bytes(8, "little") + b[8:],  # header longer than the file
        lambda b: b[:8] + b"!" + b[9:],  # header not JSON
    ],
    ids=["truncated", "long_header", "bad_json"],
)
def test_malformed_files_are_refused(tmp_path, damage):
    path = tmp_path / "d.safetensors"
    write_tensors(path, {"x": torch.ones(100)}, metadata={})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TensorFileError):
        read_tensors(path, "blake3")


def _tiny_model_and_optimizer():
    cfg = preset(
        "gpt_tiny", vocab_size=200, hidden_size=32, num_heads=2, num_layers=1, max_positions=16
    )
    torch.manual_seed(3)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def test_checkpoint_recorded_with_sha256_still_loads_and_verifies(tmp_path):
    """Checkpoints written before BLAKE3 record SHA-256: they load, and damage is found."""
    model, optimizer = _tiny_model_and_optimizer()
    step_dir = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, ps=None, state={})
    index = read_index(step_dir)
    for fname, record in index["files"].items():
        del record["blake3"]
        record["sha256"] = sha256_file(step_dir / fname)
    write_index(step_dir, {k: v for k, v in index.items() if k != "index_sha256"})
    fresh = build_model(model.cfg)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, ps=None, log=lambda m: None)
    # Full shapes: the vocabulary padding rows are not stored (they load as zeros).
    for name, value in model.full_state_dict().items():
        assert torch.equal(fresh.full_state_dict()[name], value), name
    moments = full_optimizer_state(fresh, fresh_opt)
    for name, value in full_optimizer_state(model, optimizer).items():
        assert torch.equal(moments[name], value), name
    shard = next(step_dir.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 hash does not match the index"):
        load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, ps=None, log=lambda m: None)


def test_checkpoint_benchmark_runs_every_side(tmp_path, capsys):
    """tools/bench_checkpoint.py saves and loads with all four formats and prints a ratio
    for each (the times themselves are the benchmark's, not asserted here)."""
    from studies.bench.checkpoint import main

    assert main(["--preset", "gpt_tiny", "--rounds", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for side in ("dcp", "torch.save", "safetensors"):
        line = next(row for row in out.splitlines() if row.startswith(side))
        assert line.count("x") == 2, line
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed


def test_a_destination_outside_host_memory_gets_a_host_tensor(tmp_path):
    """A file reads into host memory only: a destination elsewhere (``meta`` here stands for
    a GPU, whose memory no file read can reach) is left alone and a host tensor returned,
    for the caller to copy over (before the fix: a TypeError from ``.numpy()``, which the
    checkpoint manager reported as a malformed index on every GPU resume)."""
    t = torch.randn(4, 5)
    path = tmp_path / "d.safetensors"
    write_tensors(path, {"t": t}, metadata={})
    elsewhere = torch.empty(4, 5, device="meta")
    read, _ = read_tensors(path, "blake3", into={"t": elsewhere})
    assert read["t"].device.type == "cpu" and torch.equal(read["t"], t)
