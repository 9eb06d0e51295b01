"""The plain PyTorch GPT that tools/bench_train.py times meshtron against: the same model
and math in torch's own modules, loaded with meshtron's weights, and its training step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import OptimConfig
from engine.models import ModelConfig, ParallelModel, family
from engine.optim import FUSED_ADAMW_DEVICES

# fp32 losses of the two loops agree to summation order (~1e-7 relative per op; a few
# layers stay far below 1e-4). A larger gap means the two loops compute different models.
LOSS_RTOL = 1e-4


def builds(cfg: ModelConfig) -> bool:
    """Whether ``RefGPT`` is the model ``cfg`` describes: a decoder family of pre-norm
    layers, LayerNorm, learned positions, a bias-GeLU MLP, one KV head per query head,
    biases everywhere and a tied LM head (GPT-2's parts; the others it does not build)."""
    fam = family(cfg.arch)
    return (
        fam.causal
        and fam.pre_norm
        and not fam.token_types
        and cfg.norm == "layernorm"
        and cfg.position_embedding == "learned"
        and cfg.activation in ("gelu", "gelu_tanh")
        and cfg.kv_heads == cfg.num_heads
        and cfg.qkv_bias
        and cfg.linear_bias
        and cfg.tie_embeddings
    )


class RefBlock(nn.Module):
    """Pre-LN transformer layer; QKV rows ordered (heads, three, d) like meshtron's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layernorm_eps
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.p_attn, self.p_hidden = cfg.attention_dropout, cfg.hidden_dropout
        self.approximate = {"gelu": "none", "gelu_tanh": "tanh"}[cfg.activation]
        self.ln1, self.ln2 = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, cfg.ffn_size), nn.Linear(cfg.ffn_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # 3 × (b, heads, s, d)
        p = self.p_attn if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        att = att.transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(att), self.p_hidden, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate))
        return x + F.dropout(mlp, self.p_hidden, self.training)


class RefGPT(nn.Module):
    """GPT-2: token + position embeddings, pre-LN layers, final LayerNorm, tied LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, cfg.layernorm_eps)
        self.p_hidden = cfg.hidden_dropout

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]  # (b, s, h)
        x = F.dropout(x, self.p_hidden, self.training)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (b, s, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


_REF_NAMES = {
    "embedding.word.weight": "wte.weight",
    "embedding.position": "wpe.weight",
    "final_norm": "ln_f",
    "attention_norm": "ln1",
    "mlp_norm": "ln2",
    "attention.qkv": "qkv",
    "attention.dense": "proj",
    "mlp.fc1": "fc1",
    "mlp.fc2": "fc2",
    "layers.": "blocks.",
}


def load_reference(ref: RefGPT, model: ParallelModel) -> None:
    """Copy meshtron's full weights into the reference (one rename per module path)."""
    state = {}
    for name, tensor in model.full_state_dict().items():
        for old, new in _REF_NAMES.items():
            name = name.replace(old, new)
        state[name] = tensor
    ref.load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------
# The two training steps.


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def reference_step(forward, params, optimizer, batch, ocfg, device, dtype):
    """The textbook PyTorch step: forward (eager or compiled), backward, clip_grad_norm_, AdamW."""
    ids, labels, params = batch["input_ids"], batch["labels"], list(params)

    def step() -> torch.Tensor:
        with autocast_context(device, dtype):
            loss = forward(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ocfg.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def reference_optimizer(ref: RefGPT, ocfg: OptimConfig, device: torch.device):
    """AdamW with engine.optim's settings: decay on matrices only, same lr/betas/eps."""
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": ocfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type in FUSED_ADAMW_DEVICES or None  # build_optimizer's impl="auto" choice
    return torch.optim.AdamW(
        groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=fused
    )


def check_same_function(model: ParallelModel, ref: Callable, batch) -> float:
    """Relative gap between the two losses in eval mode (fp32); raises above LOSS_RTOL.

    Both run eagerly (a compiled model or reference included): the check is about the
    weights and the model, and compiling it in eval mode and fp32 would compile graphs
    that the timed steps (training mode, autocast) never reuse (the build that ran this
    check compiled took 49 s for GPT 1.3B on an H200, 2026-11-27)."""
    model.eval()
    ref.eval()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ours = model.loss(batch).item()
        theirs = ref(batch["input_ids"], batch["labels"]).item()
    model.train()
    ref.train()  # a compiled module passes train()/eval() to the one it wraps
    gap = abs(ours - theirs) / abs(theirs)
    if not gap <= LOSS_RTOL:
        raise SystemExit(
            f"meshtron loss {ours:.6f} vs reference {theirs:.6f} (rel {gap:.2e} > {LOSS_RTOL}): "
            "the reference no longer computes meshtron's model"
        )
    return gap


# ---------------------------------------------------------------------------------------
# Timing.
