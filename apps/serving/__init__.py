"""Serving a meshtron decoder: a paged KV cache and a continuous-batching engine.

``PagedKVCache`` (``paged_cache``) holds keys and values in fixed blocks from one pool;
``ServingEngine`` (``engine``) runs requests (``requests``) that join and leave the batch
at any step; ``http`` is their OpenAI-compatible HTTP front (``python -m apps.serve``), with
``driver`` (the one task that steps the engine), ``protocol`` (request bodies),
``responses`` (answers and stream chunks) and ``text`` (tokenizer, chat template, stop
strings); ``tp`` sends each step's plan to the other TP ranks at ``--tp-size`` > 1.
Nothing in the runtime imports this.
"""

from apps.serving.engine import ServingEngine
from apps.serving.paged_cache import BlockTable, PagedKVCache, PoolFull
from apps.serving.requests import Completion, Refused, Request, TokenEvent

__all__ = [
    "BlockTable",
    "Completion",
    "PagedKVCache",
    "PoolFull",
    "Refused",
    "Request",
    "ServingEngine",
    "TokenEvent",
]
