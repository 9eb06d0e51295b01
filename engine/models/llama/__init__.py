"""The Llama family: Llama 2/3, Mistral (its sliding window on every layer), Qwen2 (QKV bias) and the
MoE variants Mixtral and Qwen2-MoE as config variants of one decoder built through the
layer seams (RMSNorm, SwiGLU or experts, rotary, grouped-query attention).

``model`` holds the class, ``hf`` the Hugging Face name map (``moe_hf`` its expert rows),
``costs`` the FLOP, parameter and activation terms; the presets are
``configs/model/llama_*.yaml``, ``qwen2_0.5b.yaml`` and ``moe_tiny.yaml`` (one source: ``engine.models.config.preset`` reads them). Nothing is
imported here, so the family table can name this folder without an import circle.
"""
