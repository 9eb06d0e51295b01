"""The Llama-family model class: the decoder with ``model.arch=llama``."""

from __future__ import annotations

from engine.models.gpt import GPTModel


class LlamaModel(GPTModel):
    """A Llama-family causal LM: GPT's decoder with the parts its config chooses (RMSNorm,
    SwiGLU, rotary, grouped-query attention, optional QKV bias)."""

    ARCH = "llama"
