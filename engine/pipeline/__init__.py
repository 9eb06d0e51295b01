"""Pipeline parallelism: a built model cut into stages (``stages``) and run by a
``torch.distributed.pipelining`` schedule (``schedule``); the layer split (``split``) is
plain arithmetic the config checks with.

Names load on first use (PEP 562), so the config's import of the split rule does not
bring in the schedule, whose DP strategies read the config: no import loop.
"""

from __future__ import annotations

import importlib

_EXPORTS = {  # name -> the module that defines it
    "SCHEDULES": "schedule",
    "PipelineRunner": "schedule",
    "pipeline_runner": "schedule",
    "layer_split": "split",
    "PipelineModel": "stages",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
