"""The model families built from the tensor-parallel layers, their config and registry.

Nothing is imported here until it is asked for (PEP 562): the family table
(``engine.models.families``) loads without torch, so the torch-free performance model
reads it through this package, and a family's module (``GPTModel``, ``BertModel``,
``LlamaModel``: any family's ``Family.model``) loads on first use; ``build_model`` asks the
table for the class.
"""

from __future__ import annotations

import importlib

from engine.models.families import FAMILIES, Family, family

_MODEL_CLASSES = {f.model: f for f in FAMILIES.values()}  # class name -> its family
_EXPORTS = {  # name -> the module that defines it
    "ModelConfig": "config",
    "preset": "config",
    "preset_names": "config",
    "ParallelModel": "base",
    "build_model": "build",
}

__all__ = ["FAMILIES", "Family", "family", *_EXPORTS, *_MODEL_CLASSES]


def __getattr__(name: str):
    """A family's model class by its name (``engine.models.GPTModel``) or one of the
    package's names, imported now."""
    if name in _MODEL_CLASSES:
        return _MODEL_CLASSES[name].model_class()
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
