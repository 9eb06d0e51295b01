"""The Llama family: Llama 2/3, Mistral (without sliding window) and Qwen2 (QKV bias) as
config variants of one decoder built through the layer seams (RMSNorm, SwiGLU, rotary,
grouped-query attention).

``model`` holds the class, ``hf`` the Hugging Face name map, ``costs`` the FLOP,
parameter and activation terms; the presets are ``configs/model/llama_*.yaml`` and
``qwen2_0.5b.yaml`` (one source: ``engine.models.config.preset`` reads them). Nothing is
imported here, so the family table can name this folder without an import circle.
"""
