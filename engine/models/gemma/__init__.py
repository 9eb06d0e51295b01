"""The Gemma 2 family: a decoder built through the layer seams with Gemma's parts: RMSNorm
scaled by (1 + weight) before and after attention and the MLP, a GeGLU MLP, rotary
grouped-query attention with its scores scaled by ``query_pre_attn_scalar`` and
soft-capped, a sliding window on alternate layers, word embeddings scaled by
sqrt(hidden), soft-capped final logits.

``model`` holds the class, ``hf`` the Hugging Face name map (``Gemma2ForCausalLM``),
``costs`` the FLOP, parameter and activation terms; the preset is
``configs/model/gemma_tiny.yaml``. Nothing is imported here, so the family table can name
this folder without an import circle.
"""
