"""The Llama family: Llama 2/3, Mistral (without sliding window) and Qwen2 (QKV bias) as
config variants of one decoder built through the layer seams (RMSNorm, SwiGLU, rotary,
grouped-query attention). The model is GPT's decoder class with these parts chosen;
this folder holds what is specific to the family: its presets and its HF name map."""

from __future__ import annotations

from engine.models.gpt import GPTModel


class LlamaModel(GPTModel):
    """A Llama-family causal LM (``model.arch=llama``): the decoder with Llama's parts."""

    ARCH = "llama"


__all__ = ["LlamaModel"]
