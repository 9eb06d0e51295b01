"""Resumable, layout-independent training checkpoints.

Every tensor is stored at its full shape under a stable global name (``model/<param>``,
``optim/<param>/exp_avg`` ...), so a checkpoint written at one (tp, dp) — with or without
ZeRO-1 — loads at any other, and ``tools/checkpoint.py convert`` rewrites it offline.
Each rank writes only the slices it owns, into safetensors files listed with their
size and BLAKE3 hash in ``index.json``; commits are atomic and ``latest`` names the newest.
Nothing is ever unpickled.

Modules: ``layout`` (who holds and who writes which slice), ``storage`` (files, checksums,
atomic commit), ``tensorfile`` (one-pass hashed safetensors I/O), ``state`` (model/optimizer <-> named tensors), ``manager`` (the collective
save/load protocol with fallback), ``convert`` (offline reading and re-sharding),
``format`` (the model weights alone, for export, inference and Hugging Face).
"""

from engine.checkpoint.manager import Loaded, checkpoint_dir, load_checkpoint, save_checkpoint
from engine.checkpoint.state import full_optimizer_state
from engine.checkpoint.storage import CheckpointError, ShardReader, read_index

__all__ = [
    "CheckpointError",
    "Loaded",
    "ShardReader",
    "checkpoint_dir",
    "full_optimizer_state",
    "load_checkpoint",
    "read_index",
    "save_checkpoint",
]
