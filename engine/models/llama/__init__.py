"""The Llama family: Llama 2/3, Mistral (without sliding window) and Qwen2 (QKV bias) as
config variants of one decoder built through the layer seams (RMSNorm, SwiGLU, rotary,
grouped-query attention).

``model`` holds the class, ``presets`` the named sizes, ``hf`` the Hugging Face name map,
``costs`` the FLOP terms. Nothing is imported here, so config.py can read the presets.
"""
