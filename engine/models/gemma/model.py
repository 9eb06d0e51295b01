"""The Gemma 2 model class: the decoder with ``model.arch=gemma``."""

from __future__ import annotations

from engine.models.gpt import GPTModel


class Gemma2Model(GPTModel):
    """A Gemma 2 causal LM: GPT's decoder with the parts its config chooses (Gemma's
    RMSNorm before and after each branch, GeGLU, rotary grouped-query attention with a
    query scale, soft caps and a sliding window on alternate layers, scaled embeddings).
    Every one of them is a config field the shared layers read, so nothing is overridden."""

    ARCH = "gemma"
