"""What the transformer's layers read from a model config (a Protocol; engine's ModelConfig fits).

Its own module so attention, the MLP and the transformer layer can all name it without
importing each other.
"""

from __future__ import annotations

from typing import Protocol


class TransformerConfig(Protocol):
    """Every field the layers read from the model config (engine's ModelConfig fits; its
    ``validate`` checks the values). ``tests/test_layer_spec.py`` keeps this list whole."""

    hidden_size: int  # model width h
    num_heads: int  # attention heads; whole heads per TP rank
    num_kv_heads: int | None  # key/value heads (GQA; 1 = MQA); None means num_heads
    num_layers: int  # scales the init of residual-branch outputs, std / √(2·layers)
    hidden_dropout: float  # on residual branches
    attention_dropout: float  # on attention probabilities
    layernorm_eps: float  # epsilon of the norm (LayerNorm or RMSNorm)
    sequence_parallel: bool  # norms and residuals on this rank's sequence shard
    recompute: str  # "none" | "selective" (attention core) | "full" (whole layer)
    activation: str  # "gelu" (exact) | "gelu_tanh" | "swiglu" (gated, Llama)
    kernels: str  # "auto" | "torch" | "triton" | "apex"
    init_std: float  # std of the normal weight init
    norm: str  # the norm slot, a key of layers.norm.NORMS: "layernorm" | "rmsnorm"
    attention: str  # the attention slot, a key of layers.spec.ATTENTIONS: "standard"
    mlp: str  # the MLP slot, a key of layers.spec.MLPS: "dense" | "moe"
    qkv_bias: bool  # bias on the query/key/value projections
    linear_bias: bool  # bias on the attention output and MLP projections
    # Mixture of experts (mlp="moe"; layers.moe, layers.router).
    moe_num_experts: int  # E routed experts per MoE layer
    moe_top_k: int  # experts per token, k
    moe_router: str  # "softmax" (Mixtral, Qwen) | "sigmoid" (+ bias, DeepSeek-V3)
    moe_router_dtype: str  # "fp32" | "fp64": the probabilities' dtype (layers.router)
    moe_renormalize: bool  # the k chosen weights rescaled to sum 1
    moe_shared_ffn_hidden_size: int  # shared expert's inner width; 0: none
    moe_shared_gate: bool  # shared expert scaled by sigmoid(x·g) (Qwen2-MoE)
    moe_capacity_factor: float | None  # slots per expert = ⌈factor·T·k/E⌉; None: dropless
    moe_aux_loss_coeff: float  # weight of the load-balancing loss
    moe_z_loss_coeff: float  # weight of the router z-loss
    moe_bias_update_rate: float  # γ of the sigmoid router's bias update
    moe_layer_freq: int  # the MLP slot holds cfg.mlp on layers i with (i+1) % freq == 0
    # Attention's reach and scores (layers.attention; Gemma 2 sets them all).
    sliding_window: int | None  # causal attention to the last W keys; None: all
    full_attention_every: int  # layers i with (i+1) % k == 0 keep no window; 0: none such
    attn_logit_softcapping: float | None  # scores → c·tanh(scores/c); None: uncapped
    query_pre_attn_scalar: float | None  # scores scaled by scalar^-1/2; None: head_dim's
    post_norms: bool  # norms on the attention and MLP outputs before the residual add
    qk_norm: bool  # q and k normalized per head over head_dim before RoPE (Qwen3)

    @property
    def head_dim(self) -> int: ...  # one attention head's width
    @property
    def ffn_size(self) -> int: ...  # MLP inner width
    @property
    def moe_ffn_size(self) -> int: ...  # one expert's inner width
    @property
    def causal(self) -> bool: ...  # attend only to earlier positions
    @property
    def pre_layernorm(self) -> bool: ...  # pre-LN (GPT-2) rather than post-LN (BERT)
