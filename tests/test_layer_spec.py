"""The transformer layer's slots come from a spec: a new MLP is a class plus a registry entry.

Single process, float64, on the CPU (chosen explicitly, with torch's own element-wise ops),
no process group: TP size 1.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layers.spec
from engine.models import ModelConfig
from layers.attention import ParallelAttention
from layers.mlp import ParallelMLP
from layers.norm import LayerNorm, RMSNorm
from layers.spec import LayerSpec, spec_for
from layers.transformer import ParallelTransformerLayer
from layers.transformer_config import TransformerConfig
from tests.tiny_configs import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cpu")
CFG = tiny_config(vocab_size=64, hidden_size=16, max_positions=8, kernels="torch")


class ToyMLP(nn.Module):
    """A replicated two-matrix ReLU MLP with an output bias: not ParallelMLP in any way."""

    def __init__(self, cfg, *, tp_group, rng, kernels, dtype, device) -> None:
        super().__init__()
        h, ffn, factory = cfg.hidden_size, cfg.ffn_size, {"dtype": dtype, "device": device}
        self.w_in = nn.Parameter(torch.randn(ffn, h, **factory) / math.sqrt(h))
        self.w_out = nn.Parameter(torch.randn(h, ffn, **factory) / math.sqrt(ffn))
        self.b_out = nn.Parameter(torch.randn(h, **factory))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.relu(x @ self.w_in.T) @ self.w_out.T, self.b_out


def _layer(cfg: ModelConfig, **kwargs) -> ParallelTransformerLayer:
    return ParallelTransformerLayer(cfg, dtype=torch.float64, device=DEVICE, **kwargs)


def _reference(layer: ParallelTransformerLayer, x: torch.Tensor) -> torch.Tensor:
    """Pre-LN causal attention + the toy MLP, written out in torch from the layer's weights."""
    s, b, h = x.shape
    heads, eps = CFG.num_heads, CFG.layernorm_eps
    d = h // heads
    ln1, attn, ln2, mlp = layer.attention_norm, layer.attention, layer.mlp_norm, layer.mlp
    qkv = F.layer_norm(x, (h,), ln1.weight, ln1.bias, eps) @ attn.qkv.weight.T + attn.qkv.bias
    q, k, v = qkv.reshape(s, b, heads, 3, d).permute(3, 1, 2, 0, 4)  # each (b, heads, s, d)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    probs = scores.masked_fill(future, -math.inf).softmax(-1)
    context = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, h)  # heads concatenated
    x = x + context @ attn.dense.weight.T + attn.dense.bias
    y = F.layer_norm(x, (h,), ln2.weight, ln2.bias, eps)
    return x + F.relu(y @ mlp.w_in.T) @ mlp.w_out.T + mlp.b_out


def test_a_registered_mlp_fills_the_mlp_slot(monkeypatch):
    monkeypatch.setitem(layers.spec.MLPS, "toy", ToyMLP)  # removed again after the test
    cfg = ModelConfig(**{**CFG.to_dict(), "mlp": "toy"})
    cfg.validate()  # the config reads the registry when it validates, so "toy" is known
    layer = _layer(cfg)
    assert type(layer.mlp) is ToyMLP
    assert {"mlp.w_in", "mlp.w_out", "mlp.b_out"} <= set(layer.state_dict())
    # Every weight off its init (LayerNorm's ones and the zero biases would hide a
    # swapped or skipped one).
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype, device=DEVICE))
    x = torch.randn(7, 3, CFG.hidden_size, generator=gen, dtype=torch.float64, device=DEVICE)
    # float64: the layer and the reference differ only in the order of their sums (fused
    # SDPA against a written-out softmax), errors near 5e-15 on outputs up to ~13; a
    # wrong weight, slot, residual order or mask moves the output by order 1.
    torch.testing.assert_close(layer(x), _reference(layer, x), rtol=0, atol=1e-12)


def test_unknown_names_are_one_line_errors_naming_the_value_and_the_known_names():
    with pytest.raises(ValueError) as bad_config:
        ModelConfig(mlp="sparse").validate()
    assert str(bad_config.value) == "model.mlp='sparse' is not one of ('dense', 'moe')"
    with pytest.raises(ValueError) as bad_config:
        ModelConfig(attention="ring").validate()
    assert str(bad_config.value) == "model.attention='ring' is not one of ('standard',)"
    # A layer built straight from a config that was never validated says the same.
    ring = ModelConfig(**{**CFG.to_dict(), "attention": "ring"})
    with pytest.raises(ValueError) as bad_layer:
        _layer(ring)
    assert str(bad_layer.value) == "unknown attention 'ring'; known: ['standard']"
    with pytest.raises(ValueError) as bad_spec:
        spec_for(ModelConfig(norm="batchnorm"))
    assert (
        str(bad_spec.value)
        == "unknown norm 'batchnorm'; known: ['gemma_rmsnorm', 'layernorm', 'rmsnorm']"
    )


@pytest.mark.parametrize("norm, norm_class", [("layernorm", LayerNorm), ("rmsnorm", RMSNorm)])
def test_the_default_spec_builds_the_classes_it_always_did(norm, norm_class):
    cfg = ModelConfig(**{**CFG.to_dict(), "norm": norm})
    assert spec_for(cfg) == LayerSpec(norm=norm_class, attention=ParallelAttention, mlp=ParallelMLP)
    layer = _layer(cfg)
    assert [(name, type(m)) for name, m in layer.named_children()] == [
        ("attention_norm", norm_class),
        ("attention", ParallelAttention),
        ("mlp_norm", norm_class),
        ("mlp", ParallelMLP),
    ]
    norm_keys = ["weight", "bias"] if norm == "layernorm" else ["weight"]
    sublayer_keys = [f"{m}.{k}" for m in ("qkv", "dense") for k in ("weight", "bias")]
    assert list(layer.state_dict()) == (
        [f"attention_norm.{k}" for k in norm_keys]
        + [f"attention.{k}" for k in sublayer_keys]
        + [f"mlp_norm.{k}" for k in norm_keys]
        + [f"mlp.{k}" for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    )


def test_a_spec_passed_in_wins_over_the_config():
    layer = _layer(CFG, spec=LayerSpec(norm=RMSNorm, attention=ParallelAttention, mlp=ToyMLP))
    assert type(layer.attention_norm) is RMSNorm and type(layer.mlp) is ToyMLP


def _names_read_from_cfg(source: str) -> set[str]:
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "cfg"
    }


def test_the_protocol_declares_every_field_the_layers_read():
    planted = _names_read_from_cfg("def f(cfg):\n    return cfg.hidden_size + cfg.width\n")
    assert planted == {"hidden_size", "width"}  # the scanner sees attribute reads
    declared = set(TransformerConfig.__annotations__) | {
        name for name, value in vars(TransformerConfig).items() if isinstance(value, property)
    }
    read = set().union(
        *(_names_read_from_cfg(p.read_text()) for p in (ROOT / "layers").rglob("*.py"))
    )
    assert read - declared == set(), "layers read cfg fields the Protocol does not declare"
    assert declared - read == set(), "the Protocol declares fields no layer reads"
    assert all(hasattr(CFG, name) for name in declared)  # engine's ModelConfig fits it
