"""The model's structured config (a Hydra schema) and the named model-size presets."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.families import FAMILIES
from layers.compile import (
    COMPILE_BACKENDS,
    SELECTIVE_UNDER_COMPILE_FROM,
    selective_recompute_compiles,
)
from layers.kernels.dispatch import BACKENDS as KERNELS
from layers.recompute import RECOMPUTE_MODES
from layers.rotary import ROPE_SCALINGS
from layers.router import AUX_LOSS_POOLINGS, ROUTER_DTYPES, ROUTERS
from layers.spec import ATTENTIONS, MLPS
from layers.spec import NORMS as NORM_CLASSES
from layers.utils import pad_vocab_size
from parallel_state.dims import check_width_split

ARCHS = tuple(FAMILIES)  # engine/models/families.py
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")
POSITIONS = ("learned", "rotary")
# What a resumed run must keep as its checkpoint has it: the keys that decide which weights
# exist, their shapes and the function they were trained to compute. Everything else
# (dropout, init, recompute, kernels, compile, sequence_parallel, the vocabulary padding,
# the layout, the optimizer and the loop) may change on resume.
RESUME_FIXED = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "attention_head_dim",
    "ffn_hidden_size",
    "max_positions",
    "num_token_types",
    "tie_embeddings",
    "norm",
    "attention",
    "mlp",
    "position_embedding",
    "activation",
    "qkv_bias",
    "linear_bias",
    "layernorm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "moe_num_experts",
    "moe_top_k",
    "moe_ffn_hidden_size",
    "moe_router",
    "moe_renormalize",
    "moe_shared_ffn_hidden_size",
    "moe_shared_gate",
    "moe_layer_freq",
    "sliding_window",
    "full_attention_every",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "embedding_scale",
    "post_norms",
    "qk_norm",
)
# Keys whose null means a default from the others: compared with that default applied.
_APPLIED = {
    "num_kv_heads": "kv_heads",
    "attention_head_dim": "head_dim",
    "ffn_hidden_size": "ffn_size",
    "moe_ffn_hidden_size": "moe_ffn_size",
}


@dataclass
class ModelConfig:
    """Architecture and per-layer options of a model of any family (the dataclass's own
    defaults are GPT-2 small's; a preset, configs/model/*.yaml, chooses a run's)."""

    arch: str = "gpt"  # the family (engine/models/families.py): "gpt", "bert", "llama", "gemma"
    vocab_size: int = 50257  # real vocabulary; the embedding is padded beyond it
    hidden_size: int = 768  # model width h
    num_layers: int = 12  # transformer layers
    num_heads: int = 12  # attention heads; must divide by the TP size
    ffn_hidden_size: int | None = None  # MLP inner width; None means 4 * hidden_size
    max_positions: int = 1024  # learned position embeddings (longest sequence)
    hidden_dropout: float = 0.1  # dropout on embeddings and residual branches
    attention_dropout: float = 0.1  # dropout on attention probabilities
    layernorm_eps: float = 1e-5  # LayerNorm epsilon (GPT-2 1e-5, BERT 1e-12)
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of tp_size * this
    sequence_parallel: bool = False  # shard LayerNorm/dropout activations along the sequence
    recompute: str = "none"  # activation recomputation: "none", "selective" or "full"
    num_token_types: int = 2  # BERT segment (token type) embeddings
    init_std: float = 0.02  # std of the normal init of weights
    activation: str = "gelu_tanh"  # "gelu_tanh" (GPT-2's tanh), "gelu" (exact), "swiglu"
    # (Llama), "geglu" (Gemma: gelu_tanh(gate) · up)
    tie_embeddings: bool = True  # LM head reuses the word embedding
    kernels: str = "auto"  # element-wise ops: "auto" (Triton on CUDA), "triton", "apex", "torch"
    # torch.compile the whole forward and loss (layers.compile). None (the default) is
    # "auto": compiled on CUDA where the layout runs compiled (pp 1, no FSDP2; see
    # engine.config.resolve_compile), eager elsewhere. Measured on an H200 (docs/BENCHMARKS.md,
    # GPU check): GPT 350M bf16 steps 1.39x faster compiled than eager on 2026-11-26, 1.40x
    # and 1.44x in two windows on 2026-11-27 (161,970 against 112,519 tokens/s at 147bf0f),
    # llama_1b 1.17x and 1.21x; 1.43x and 1.21x on 2026-11-28 (1bfd923). On CPU the eager
    # step stays the default.
    compile: bool | None = None
    compile_backend: str = "inductor"  # torch.compile backend: "inductor", "aot_eager" or "eager"
    # The compiled step replayed as CUDA graphs (reduce-overhead). Off by default: 1.02x the
    # compiled step at GPT 350M on an H200 (2026-11-27), 1.03x on 2026-11-28, for 20-30 s
    # more compilation, and refused at pp > 1, under FSDP2 and at cp > 1.
    cuda_graphs: bool = False
    # Component seams (defaults: GPT-2's parts). Llama-family decoders pick the others.
    norm: str = "layernorm"  # "layernorm", "rmsnorm" (no bias, no mean subtraction) or
    # "gemma_rmsnorm" (RMSNorm scaled by 1 + weight, the weight starting at zero)
    attention: str = "standard"  # the attention class (layers/spec.py ATTENTIONS): "standard"
    mlp: str = "dense"  # the MLP class (layers/spec.py MLPS): "dense" (GeLU or SwiGLU)
    position_embedding: str = "learned"  # "learned" absolute table or "rotary" (RoPE)
    num_kv_heads: int | None = None  # key/value heads (GQA; 1 = MQA); None means num_heads
    attention_head_dim: int | None = None  # one head's width; None: hidden_size / num_heads
    # (Gemma 2's released sizes have their own: 2304 wide, 8 heads of 256)
    qkv_bias: bool = True  # bias on the query/key/value projections (Llama none, Qwen2 yes)
    linear_bias: bool = True  # bias on attention output and MLP projections (Llama none)
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: str = "none"  # "none" or "llama3" (Llama 3.1+ long-context frequencies)
    rope_scaling_factor: float = 8.0  # llama3 scaling: factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low_freq_factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high_freq_factor
    rope_original_max_positions: int = 8192  # llama3 scaling: original context length
    # Mixture of experts, read under mlp="moe" (layers/moe.py, layers/router.py).
    moe_num_experts: int = 8  # routed experts per MoE layer, E
    moe_top_k: int = 2  # experts each token goes to, k
    moe_ffn_hidden_size: int | None = None  # one expert's inner width; None means ffn_size
    moe_router: str = "softmax"  # "softmax" (Mixtral, Qwen) or "sigmoid" (+ bias, DeepSeek-V3)
    moe_router_dtype: str = "fp32"  # routing probabilities' dtype: "fp32" (as HF) or "fp64"
    moe_renormalize: bool = True  # rescale the k weights to sum 1 (Mixtral, Qwen3; Qwen2 not)
    moe_shared_ffn_hidden_size: int = 0  # shared expert's inner width (Qwen2-MoE); 0: none
    moe_shared_gate: bool = True  # scale the shared expert by sigmoid(x·g) (Qwen2-MoE)
    moe_capacity_factor: float | None = None  # per expert ⌈factor·T·k/E⌉ slots; None: dropless
    moe_aux_loss_coeff: float = 0.01  # weight of the load-balancing loss in the trainer's loss
    moe_z_loss_coeff: float = 0.0  # weight of the router z-loss
    # How the load-balancing loss covers the MoE layers: "layer" (each layer's own loss,
    # summed) or "model" (f and P pooled over all layers first, transformers' aux_loss;
    # an HF import of Mixtral / Qwen-MoE sets it)
    moe_aux_loss_pooling: str = "layer"
    moe_bias_update_rate: float = 0.001  # γ of the sigmoid router's bias update (DeepSeek-V3)
    moe_layer_freq: int = 1  # experts on layers i with (i + 1) % freq == 0, dense elsewhere
    # Attention's reach and scores (any causal family; Gemma 2 sets them all).
    sliding_window: int | None = None  # a query sees its last W keys (itself included); None: all
    full_attention_every: int = 0  # 0: the window on every layer; k: layers i with
    # (i + 1) % k == 0 attend to all keys (Gemma 2: 2, layers 1, 3, ... full)
    attn_logit_softcapping: float | None = None  # scores → c·tanh(scores/c) before the mask
    final_logit_softcapping: float | None = None  # LM logits → c·tanh(logits/c)
    query_pre_attn_scalar: float | None = None  # scores scaled by scalar^-1/2; None: head_dim's
    embedding_scale: bool = False  # word embeddings × sqrt(hidden_size) (Gemma)
    post_norms: bool = False  # a norm on attention's and the MLP's outputs too (Gemma 2)
    qk_norm: bool = False  # q and k normalized per head (model.norm's class over head_dim,
    # its own [head_dim] weight each) before RoPE (Qwen3)

    @property
    def ffn_size(self) -> int:
        """The MLP inner width with the default applied."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn_size(self) -> int:
        """One expert's inner width with the default (the dense MLP's) applied."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``attention_head_dim``, else hidden / heads)."""
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads with the default (one per query head) applied."""
        return self.num_kv_heads or self.num_heads

    def _trait(self, name: str) -> bool:
        """A trait of the family ``arch`` names. A name validate refuses reads as GPT's, so
        that a run's other checks still run and report beside that error."""
        return getattr(FAMILIES.get(self.arch, FAMILIES["gpt"]), name)

    @property
    def causal(self) -> bool:
        """Decoders (GPT, Llama) attend only to earlier positions; BERT to all unpadded ones."""
        return self._trait("causal")

    @property
    def pre_layernorm(self) -> bool:
        """Decoders normalize each sub-layer's input; original BERT its residual sum."""
        return self._trait("pre_norm")

    @property
    def rope_scaling_args(self) -> tuple[float, float, float, int] | None:
        """The Llama 3 frequency-scaling numbers, or None without scaling."""
        if self.rope_scaling == "none":
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_positions,
        )

    def resume_changes(self, saved: ModelConfig) -> list[tuple[str, Any, Any]]:
        """``(key, saved value, this value)`` of every :data:`RESUME_FIXED` key in which
        this config differs from the ``saved`` one a run would resume from."""
        changes = []
        for key in RESUME_FIXED:
            if getattr(saved, key) is None and getattr(self, key) is None:
                continue  # both follow the keys they default from, compared on their own
            old, new = (getattr(c, _APPLIED.get(key, key)) for c in (saved, self))
            if old != new:
                changes.append((key, old, new))
        return changes

    def padded_vocab_size(self, tp_size: int) -> int:
        """Embedding rows at this TP size: the vocabulary rounded up so every rank gets a block."""
        return pad_vocab_size(self.vocab_size, tp_size * self.make_vocab_size_divisible_by)

    def validate(self, tp_size: int = 1) -> None:
        """Raise ValueError naming the offending key and numbers if this config cannot run."""
        for key, value, allowed in (
            ("arch", self.arch, ARCHS),
            ("recompute", self.recompute, RECOMPUTE_MODES),
            ("activation", self.activation, ACTIVATIONS),
            ("kernels", self.kernels, KERNELS),
            ("compile_backend", self.compile_backend, COMPILE_BACKENDS),
            # The slot registries are read now, so a class registered at run time counts.
            ("norm", self.norm, tuple(NORM_CLASSES)),
            ("attention", self.attention, tuple(ATTENTIONS)),
            ("mlp", self.mlp, tuple(MLPS)),
            ("position_embedding", self.position_embedding, POSITIONS),
            ("rope_scaling", self.rope_scaling, ROPE_SCALINGS),
            ("moe_router", self.moe_router, ROUTERS),
            ("moe_router_dtype", self.moe_router_dtype, tuple(ROUTER_DTYPES)),
            ("moe_aux_loss_pooling", self.moe_aux_loss_pooling, AUX_LOSS_POOLINGS),
        ):
            if value not in allowed:
                raise ValueError(f"model.{key}={value!r} is not one of {allowed}")
        self._validate_numbers()
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(
                f"model.make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} "
                "must be >= 1"
            )
        if self.attention_head_dim is not None and self.attention_head_dim < 1:
            raise ValueError(
                f"model.attention_head_dim={self.attention_head_dim} must be >= 1 (or null: "
                "hidden_size / num_heads)"
            )
        if self.attention_head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_heads={self.num_heads}"
            )
        self._validate_rope()
        if self.mlp == "moe":
            self._validate_moe(tp_size)
        if self.cuda_graphs:
            self._validate_cuda_graphs()
        self._validate_attention_reach()
        selective = self.compile and self.recompute == "selective" and tp_size > 1
        if selective and not selective_recompute_compiles():
            raise ValueError(
                f"model.compile=true with model.recompute=selective at tp_size={tp_size} "
                f"gives wrong gradients on this torch ({torch.__version__}); use torch >= "
                f"{SELECTIVE_UNDER_COMPILE_FROM}, or model.recompute=full or none"
            )
        # Whole heads and MLP columns per TP rank.
        check_width_split("model.num_heads", self.num_heads, tp_size)
        check_width_split("model.ffn_hidden_size", self.ffn_size, tp_size)
        self._validate_heads(tp_size)
        if self._trait("token_types") and self.num_token_types < 1:
            raise ValueError(
                f"model.num_token_types={self.num_token_types} must be >= 1 for model.arch={self.arch}"
            )

    def _validate_numbers(self) -> None:
        """Sizes at least 1; epsilon, init scale and dropout in their ranges (NaN fails)."""
        # moe_layer_freq for every mlp: layers.spec.spec_for divides by it.
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "max_positions",
            "moe_layer_freq",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(
                f"model.ffn_hidden_size={self.ffn_hidden_size} must be >= 1 (or null: 4 × "
                "hidden_size)"
            )
        # Written as what must hold, so that NaN (false in every comparison) fails it too.
        if not 0 < self.layernorm_eps < math.inf:
            raise ValueError(f"model.layernorm_eps={self.layernorm_eps} must be > 0 and finite")
        if not 0 <= self.init_std < math.inf:
            raise ValueError(f"model.init_std={self.init_std} must be >= 0 and finite")
        if self.init_std == 0:
            raise ValueError(
                "model.init_std=0.0 starts every weight at zero, where every gradient is "
                "zero too and no step moves them: give it > 0 (GPT-2's 0.02)"
            )
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be in [0, 1)")

    def _validate_attention_reach(self) -> None:
        """The sliding window, the soft caps and the query scale: positive and finite; the
        window and the post norms on the families they are built for."""
        window = self.sliding_window
        if window is not None and window < 1:
            raise ValueError(f"model.sliding_window={window} must be >= 1 (or null: no window)")
        if window is not None and not self.causal:
            raise ValueError(
                f"model.sliding_window limits causal attention; model.arch={self.arch} "
                "attends both ways: set model.sliding_window=null"
            )
        if self.full_attention_every < 0:
            raise ValueError(
                f"model.full_attention_every={self.full_attention_every} must be >= 0 "
                "(0: the window on every layer)"
            )
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, key)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"model.{key}={value} must be > 0 and finite (or null: none)")
        if self.post_norms and not self.pre_layernorm:
            raise ValueError(
                f"model.post_norms=true adds norms to pre-norm layers; model.arch={self.arch} "
                "normalizes the residual sum: set model.post_norms=false"
            )

    def _validate_moe(self, tp_size: int) -> None:
        """Experts, k, widths and coefficients in range; widths split over TP; no expert
        biases."""
        experts, k = self.moe_num_experts, self.moe_top_k
        if experts < 1:
            raise ValueError(f"model.moe_num_experts={experts} must be >= 1 under model.mlp=moe")
        if not 1 <= k <= experts:
            raise ValueError(f"model.moe_top_k={k} must be in [1, model.moe_num_experts={experts}]")
        ffn, shared = self.moe_ffn_hidden_size, self.moe_shared_ffn_hidden_size
        if ffn is not None and ffn < 1:
            raise ValueError(
                f"model.moe_ffn_hidden_size={ffn} must be >= 1 (or null: model.ffn_hidden_size)"
            )
        if shared < 0:
            raise ValueError(
                f"model.moe_shared_ffn_hidden_size={shared} must be >= 0 (0: no shared expert)"
            )
        factor = self.moe_capacity_factor
        if factor is not None and not 0 < factor < math.inf:
            raise ValueError(
                f"model.moe_capacity_factor={factor} must be > 0 and finite (or null: dropless)"
            )
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_bias_update_rate"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 0 and finite")
        # Each expert's columns split over TP as the dense MLP's (layers.moe).
        check_width_split("model.moe_ffn_hidden_size", self.moe_ffn_size, tp_size)
        check_width_split("model.moe_shared_ffn_hidden_size", shared, tp_size)
        if self.linear_bias:
            raise ValueError(
                "model.mlp=moe: experts carry no biases (Mixtral, Qwen-MoE): set "
                "model.linear_bias=false"
            )

    def _validate_cuda_graphs(self) -> None:
        """CUDA graphs are inductor's ``mode="reduce-overhead"`` of the compiled step, which
        replays static shapes and device work only."""
        if not self.compile or self.compile_backend != "inductor":
            raise ValueError(
                "model.cuda_graphs=true replays the compiled step: set model.compile=true "
                f"and model.compile_backend=inductor (got compile={self.compile}, "
                f"compile_backend={self.compile_backend!r})"
            )
        if self.hidden_dropout > 0 or self.attention_dropout > 0:
            raise ValueError(
                "model.cuda_graphs=true needs model.hidden_dropout=0 and "
                "model.attention_dropout=0: dropout masks are drawn by switching RNG streams on "
                "the host, which a CUDA graph cannot replay"
            )

    def _validate_rope(self) -> None:
        """RoPE's base, and Llama 3's scaling numbers when it scales: any other value
        makes every rotation, and so every step, NaN (or divides by zero)."""
        if not 0 < self.rope_theta < math.inf:
            raise ValueError(f"model.rope_theta={self.rope_theta} must be > 0 and finite")
        if self.rope_scaling != "llama3":
            return
        factor, low, high = (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
        )
        if not 0 < factor < math.inf:
            raise ValueError(
                f"model.rope_scaling_factor={factor} must be > 0 and finite under "
                "model.rope_scaling=llama3 (or model.rope_scaling=none)"
            )
        if not 0 < low < high < math.inf:
            raise ValueError(
                f"model.rope_low_freq_factor={low} and model.rope_high_freq_factor={high} "
                "must be finite with 0 < low < high under model.rope_scaling=llama3"
            )
        if self.rope_original_max_positions < 1:
            raise ValueError(
                f"model.rope_original_max_positions={self.rope_original_max_positions} "
                "must be >= 1 under model.rope_scaling=llama3"
            )

    def _validate_heads(self, tp_size: int) -> None:
        """Query heads group evenly over KV heads; KV heads split over TP or TP over them."""
        if self.num_kv_heads is not None and self.num_kv_heads < 1:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} must be >= 1 (or null: one per query head)"
            )
        kv = self.kv_heads
        if kv < 1 or self.num_heads % kv:
            raise ValueError(
                f"model.num_kv_heads={kv} must be >= 1 and divide model.num_heads={self.num_heads}"
            )
        if kv % tp_size and tp_size % kv:
            raise ValueError(
                f"model.num_kv_heads={kv} and tp_size={tp_size}: one must divide the other "
                "(KV heads are split over TP ranks, or each replicated on tp_size/kv ranks)"
            )
        if self.position_embedding == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")

    def to_dict(self) -> dict[str, Any]:
        """Plain field values (for JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from :meth:`to_dict` output (JSON read back); a ValueError naming the key
        for an unknown key or a value of the wrong type (an int stands for a float)."""
        if not isinstance(values, dict):
            raise ValueError(f"the model config is a {type(values).__name__}, expected an object")
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(values) - set(hints))
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}")
        return cls(**{key: _typed(key, value, hints[key]) for key, value in values.items()})


def _typed(key: str, value: Any, hint: Any) -> Any:
    """``value`` as field ``key`` of type ``hint`` holds it (an int as a float where a float
    is due); a ValueError naming the key when it is of another type."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return value
    if isinstance(value, bool):  # bool is an int to isinstance: only a bool field takes it
        if bool in allowed:
            return value
    elif isinstance(value, int) and int in allowed:
        return value
    elif isinstance(value, int | float) and float in allowed:
        return float(value)
    elif isinstance(value, str) and str in allowed:
        return value
    expected = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    got = "null" if value is None else f"a {type(value).__name__}"
    raise ValueError(f"model.{key}={value!r} is {got}, expected {expected}")


# The presets' values live in configs/model/NAME.yaml, the files Hydra composes for
# ``model=NAME``; ``preset`` reads the same files, so a name means one model everywhere.
# Sources: GPT-2 small/medium (Radford et al. 2019, released configs); BERT base/large
# (Devlin et al. 2019); the 1.3B model is "GPT-3 XL" (Brown et al. 2020, Table 2.1: 24
# layers, d_model 2048, context 2048, d_head 128). That table also lists 24 heads, which
# does not multiply with d_head 128 to 2048; we keep d_head 128, i.e. 16 heads, as
# Megatron-LM's 1.3B GPT recipe does. gpt_tiny's vocabulary (8192) is the embedded corpus's.
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"


def preset_names() -> list[str]:
    """Every model preset: the YAML files in configs/model (the schema aside)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if p.stem != "schema")


def preset_of(cfg: ModelConfig) -> str | None:
    """The preset whose every :data:`RESUME_FIXED` key equals ``cfg``'s (the first by name),
    or None: what ``model=NAME`` rebuilds a checkpoint's model from."""
    return next((n for n in preset_names() if not preset(n).resume_changes(cfg)), None)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of configs/model/NAME.yaml, as Hydra composes it, with ``overrides``."""
    if name not in preset_names():
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    from omegaconf import OmegaConf  # Hydra's config library, imported when first needed

    values = OmegaConf.load(PRESET_DIR / f"{name}.yaml")
    values.pop("defaults", None)
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))
    return dataclasses.replace(typed, **overrides)
