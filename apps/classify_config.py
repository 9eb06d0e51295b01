"""The Fashion-MNIST classifier's config tree (``python -m apps.classify``): the Hydra
schemas (dataclasses) that configs/classify.yaml chooses values for.

Its own tree, not a section of engine/config.py's: the engine knows nothing of its apps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class ClassifyDataConfig:
    """Where the IDX files are and how much of them to use."""

    dir: str = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist location
    train_subset: int = 0  # use only the first N training images; 0: all 60,000
    test_subset: int = 0  # evaluate on the first N test images; 0: all 10,000


@dataclass
class ClassifyModelConfig:
    """An MLP: 784 → hidden (column-parallel) → hidden (row-parallel) → 10."""

    hidden_size: int = 256  # width of the two hidden layers; divisible by tp_size
    dtype: str = "float32"  # "float32" or "float64" (float64 for exactness tests)


@dataclass
class ClassifyTrainerConfig:
    """The loop: epochs of SGD with momentum, evaluated on the test set after each."""

    batch_size: int = 64  # images per rank per step (the tutorials' --batch-size)
    lr: float = 0.02  # SGD learning rate (see docs/SCALING.md for larger global batches)
    lr_scaling: str = "none"  # "linear": multiply lr by dp_size (the large-batch rule)
    momentum: float = 0.9  # SGD momentum
    epochs: int = 10  # stop after this many epochs even below the target (--epochs)
    target_accuracy: float = 0.75  # stop once the test accuracy reaches this (--target-accuracy)
    seed: int = 1234  # init and shuffling seed
    grad_bucket_mb: float = 25.0  # DP all-reduce bucket size
    # Intra-op threads per rank, at most (0: the rank's whole share of the cores). The MLP's
    # matmuls are too small to gain from threads: 2 ran 2.8x (idle) to 30x (busy) slower than 1.
    threads: int = 1
    memory_cap_gib: float = 0.0  # per-rank memory budget (0: the device's); enforced on CUDA
    progress: bool = True  # rich progress bar on rank 0
    metrics_file: str | None = None  # rank 0 writes per-step timings and a summary here (JSON)


@dataclass
class ClassifyLaunchConfig:
    """Self-launch: ranks per node and nodes, torchrun-style (ignored under a launcher)."""

    num_nodes: int = 1  # nodes taking part (--num-nodes)
    node_id: int = 0  # this node's index in [0, num_nodes) (--node-id)
    ranks_per_node: int | None = None  # processes (GPUs) per node (--num-gpus); None: tp×dp
    master_addr: str | None = None  # node 0's address; default $MASTER_ADDR or 127.0.0.1
    master_port: int | None = None  # rendezvous port; default $MASTER_PORT or 29500
    rendezvous_timeout_s: float = 300.0  # every rank must join within this, else it stops


@dataclass
class ClassifyConfig:
    """Everything ``python -m apps.classify`` needs."""

    data: ClassifyDataConfig = field(default_factory=ClassifyDataConfig)
    model: ClassifyModelConfig = field(default_factory=ClassifyModelConfig)
    trainer: ClassifyTrainerConfig = field(default_factory=ClassifyTrainerConfig)
    launch: ClassifyLaunchConfig = field(default_factory=ClassifyLaunchConfig)
    tp_size: int = 1  # tensor-parallel size of the hidden layers
    dp_size: Any = "auto"  # data-parallel size, or "auto" for world size ÷ tp_size


def register_classify_configs() -> None:
    """Register the classifier's schema in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="classify_schema", node=ClassifyConfig)
