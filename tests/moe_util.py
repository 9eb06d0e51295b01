"""The tiny mixture-of-experts configs the MoE tests share (no transformers import, so
that the multi-rank tests' ranks start fast)."""

from __future__ import annotations

from engine.models import ModelConfig
from tests.tiny_configs import LLAMA, SWIGLU, tiny_kwargs

__all__ = [
    "EXPERTS",
    "FFN",
    "H",
    "LLAMA",
    "moe_cfg",
    "moe_tiny_run",
]  # LLAMA: the MoE tests import it here
H, FFN, EXPERTS = 16, 12, 6


def moe_cfg(**overrides) -> ModelConfig:
    """Two layers of hidden 16, both with 6 SwiGLU experts of width 12, top-2; validated."""
    base = tiny_kwargs(hidden_size=H, num_heads=2, vocab_size=64, max_positions=16, **SWIGLU)
    moe = dict(mlp="moe", moe_num_experts=EXPERTS, moe_top_k=2, moe_ffn_hidden_size=FFN)
    cfg = ModelConfig(**{**base, "kernels": "torch", **moe, **overrides})
    cfg.validate()
    return cfg


def moe_tiny_run(prefix, tokenizer, steps: int) -> list[str]:
    """``engine.pretrain`` overrides of a one-rank ``moe_tiny`` run of ``steps`` steps on a
    test corpus (32-token sequences, vocabulary 512), without evaluation or sample."""
    return [
        "model=moe_tiny",
        "tp_size=1",
        "dp_size=1",
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=32",
        "model.vocab_size=512",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        "trainer.sample_tokens=0",
    ]
