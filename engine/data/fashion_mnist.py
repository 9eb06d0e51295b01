"""Fashion-MNIST from the IDX files that Debian's ``dataset-fashion-mnist`` package installs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.data.idx import read_idx

# Where `apt-get install dataset-fashion-mnist` puts the files (see `dpkg -L`).
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


@dataclass(frozen=True)
class ImageSplits:
    """Images as float32 ``[n, 784]`` scaled to [0, 1], labels as int64 ``[n]``."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def find_files(directory: str | os.PathLike) -> dict[str, Path]:
    """The four IDX paths in ``directory`` (``.gz`` or plain); FileNotFoundError in one line
    saying how to install the data set when any is missing."""
    directory, found = Path(directory), {}
    for key, stem in FILES.items():
        for candidate in (directory / f"{stem}.gz", directory / stem):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            raise FileNotFoundError(
                f"Fashion-MNIST not found: no {stem}[.gz] in {directory}; install it with "
                "`sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu) or set "
                "data.dir=DIR to a directory holding the four IDX files"
            )
    return found


def load(directory: str | os.PathLike = DEBIAN_DIR) -> ImageSplits:
    """Read and check the four files of ``directory``."""
    paths = find_files(directory)
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{paths[f'{split}_images']}: images {list(images.shape)} do not pair with "
                f"labels {list(labels.shape)} (expected [n, rows, cols] and [n])"
            )
    flat = lambda x: x.reshape(x.shape[0], -1).float().div_(255.0)  # noqa: E731
    return ImageSplits(
        flat(arrays["train_images"]),
        arrays["train_labels"].long(),
        flat(arrays["test_images"]),
        arrays["test_labels"].long(),
    )
