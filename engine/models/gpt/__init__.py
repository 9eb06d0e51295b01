"""The GPT-2 family: the decoder with learned positions, pre-LN layers, a final LayerNorm
and a tied LM head. Its subclass ``engine.models.llama`` swaps those parts by config.

``model`` holds the class and the vocab-parallel loss, ``hf`` the Hugging Face name map
(``GPT2LMHeadModel``), ``costs`` the FLOP and parameter terms. The presets are
``configs/model/gpt_*.yaml``.
"""

from engine.models.gpt.model import GPTModel, vocab_parallel_losses

__all__ = ["GPTModel", "vocab_parallel_losses"]
