"""Data pipeline: preprocessing to indexed token files, datasets, blending and DP loading;
``pipeline`` turns the data config into a rank's iterators.

Names are imported lazily so that preprocessing (and its spawned workers) does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IndexedDataset": "indexed",
    "IndexedDatasetWriter": "indexed",
    "GPTDataset": "gpt_dataset",
    "BertDataset": "bert_dataset",
    "BlendedDataset": "blend",
    "split_documents": "blend",
    "DataIterator": "loader",
    "build_default_corpus": "default_corpus",
    "preprocess": "preprocess",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
