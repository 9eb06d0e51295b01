"""The mixture-of-experts variants of the Llama family's Hugging Face map: Mixtral
(``MixtralForCausalLM``), Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE
(``Qwen3MoeForCausalLM``), read by ``hf.py``.

All three are the Llama decoder with ``model.mlp=moe`` (``layers.moe``): softmax top-k routing
in fp32, as transformers' routers. Mixtral renormalises the k weights and has experts on
every layer; Qwen2-MoE renormalises when ``norm_topk_prob``, adds a sigmoid-gated shared
expert, and holds experts on layers i with (i + 1) % ``decoder_sparse_step`` == 0 (our
``moe_layer_freq``), dense MLPs of ``intermediate_size`` elsewhere. Qwen3-MoE is Qwen2-MoE
without the shared expert and with QK norms (``model.qk_norm``, mapped in ``hf.py``); its
``mlp_only_layers`` is taken where the layers it leaves with experts are every k-th.

Expert weights, per layer (transformers' ``save_pretrained`` writes one tensor per expert;
its in-memory modules hold them fused, which an import also reads):

* ``w1`` / ``gate_proj`` and ``w3`` / ``up_proj`` ``[f, h]`` of expert e ↔ ``experts.fc1[e]``
  ``[h, 2f]``, columns ``(f two)`` (gate and up interleaved, as ``layers.mlp``);
* ``w2`` / ``down_proj`` ``[h, f]`` ↔ ``experts.fc2[e]`` ``[f, h]``;
* ``gate.weight`` ``[E, h]`` ↔ ``router.weight``.

Pure slicing, stacking and transposition: HF → meshtron → HF is bitwise.

The load-balancing loss counts in training where transformers counts it: with
``output_router_logits`` its weight is ``router_aux_loss_coef``, without it 0; and as
transformers computes it, pooled over the model's MoE layers (``moe_aux_loss_pooling``
"model", ``layers.router.router_objective``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from engine.models import hf_layout as layout
from engine.models.config import ModelConfig
from engine.models.hf_layout import ConfigKey, Transform, Weights, rename

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Defaults: transformers' config classes' (5.24), for a config.json that omits a key.
KEYS = {
    "mixtral": (
        ConfigKey("moe_num_experts", "num_local_experts", 8),
        ConfigKey("moe_top_k", "num_experts_per_tok", 2),
        ConfigKey("moe_ffn_hidden_size", "intermediate_size", export="moe_ffn_size"),
    ),
    "qwen2_moe": (
        ConfigKey("moe_num_experts", "num_experts", 60),
        ConfigKey("moe_top_k", "num_experts_per_tok", 4),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size", 1408, export="moe_ffn_size"),
        ConfigKey("moe_shared_ffn_hidden_size", "shared_expert_intermediate_size", 5632),
        ConfigKey("moe_renormalize", "norm_topk_prob", False),
        ConfigKey("moe_layer_freq", "decoder_sparse_step", 1),
    ),
    # transformers 5 saves num_experts as num_local_experts; both are read (_QWEN3_EXPERTS).
    "qwen3_moe": (
        ConfigKey("moe_num_experts", "num_experts", 128),
        ConfigKey("moe_top_k", "num_experts_per_tok", 8),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size", 768, export="moe_ffn_size"),
        ConfigKey("moe_renormalize", "norm_topk_prob", False),
        ConfigKey("moe_layer_freq", "decoder_sparse_step", 1),
    ),
}
_QWEN3_EXPERTS = ("num_experts", "num_local_experts")
# Where each kind keeps a layer's experts, and their per-expert names (gate, up, down).
_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp"}
_QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": _QWEN_EXPERTS,
    "qwen3_moe": _QWEN_EXPERTS,
}


def moe_kind(cfg: ModelConfig) -> str:
    """The ``model_type`` an MoE config exports as: Qwen3-MoE with QK norms, Qwen2-MoE with
    a shared expert, else Mixtral; a one-line ValueError for what none computes."""
    if cfg.moe_router != "softmax":
        raise ValueError(
            f"model.moe_router={cfg.moe_router!r} has no Hugging Face MoE class here; "
            "Mixtral and Qwen-MoE route by softmax"
        )
    if cfg.qk_norm:
        if cfg.moe_shared_ffn_hidden_size or cfg.qkv_bias:
            raise ValueError(
                "model.qk_norm=true with experts exports as Qwen3-MoE, which has no shared "
                "expert and no QKV bias: set model.moe_shared_ffn_hidden_size=0 and "
                "model.qkv_bias=false"
            )
        return "qwen3_moe"
    if cfg.moe_shared_ffn_hidden_size:
        if not cfg.moe_shared_gate:
            raise ValueError(
                "model.moe_shared_gate=false: Qwen2-MoE always gates its shared expert; set it true"
            )
        return "qwen2_moe"
    if not cfg.moe_renormalize or cfg.moe_layer_freq != 1:
        raise ValueError(
            "an MoE model without a shared expert exports as Mixtral, which renormalises "
            "the top-k weights on every layer: set model.moe_renormalize=true and "
            "model.moe_layer_freq=1"
        )
    return "mixtral"


def config_values(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.moe_*`` fields (and ``mlp``) of a Mixtral or Qwen2-MoE ``config.json``;
    unsupported variants raise a one-line ValueError naming the key."""
    kind = hf["model_type"]
    if kind == "qwen3_moe":
        hf = _qwen3_experts(hf)
    values = layout.config_values(hf, KEYS[kind])
    if kind == "mixtral":
        noise = layout.hf_value(hf, "router_jitter_noise", float, 0.0)
        if noise != 0:
            raise ValueError(f"router_jitter_noise {noise} is not supported; set it to 0.0")
    elif kind == "qwen3_moe":
        values["moe_layer_freq"] = _expert_layer_freq(hf, values["moe_layer_freq"])
    else:
        if hf.get("mlp_only_layers") not in (None, []):
            raise ValueError(
                "mlp_only_layers is not supported; set it to [] (decoder_sparse_step "
                "chooses the expert layers)"
            )
        if values["moe_shared_ffn_hidden_size"] < 1:
            size = values["moe_shared_ffn_hidden_size"]
            raise ValueError(
                f"shared_expert_intermediate_size {size}: Qwen2-MoE's shared expert needs >= 1"
            )
    coeff = layout.hf_value(hf, "router_aux_loss_coef", float, 0.001)
    counted = layout.hf_value(hf, "output_router_logits", bool, False)
    return dict(
        values,
        mlp="moe",
        moe_aux_loss_coeff=float(coeff) if counted else 0.0,
        moe_aux_loss_pooling="model",  # transformers' aux_loss: f and P over all layers
    )


def _qwen3_experts(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with its expert count under ``num_experts`` (the hub's spelling), however it
    was written; one line where both spellings are there and disagree."""
    given = {name: hf[name] for name in _QWEN3_EXPERTS if name in hf}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"config.json {given}: the two expert counts disagree; keep one")
    return {**hf, _QWEN3_EXPERTS[0]: given.popitem()[1]} if given else hf


def _expert_layer_freq(hf: dict[str, Any], step: int) -> int:
    """``moe_layer_freq`` of a Qwen3-MoE config: ``decoder_sparse_step``, or where
    ``mlp_only_layers`` removes experts too, the k whose every k-th layer is exactly the
    layers left with experts; one line if there is none."""
    only = hf.get("mlp_only_layers") or []
    if not only or step < 1:  # a step below 1 is the validation's to report
        return step
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError(f"config.json mlp_only_layers={only!r}: expected a list of integers")
    layers = layout.hf_value(hf, "num_hidden_layers", int)
    sparse = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    for freq in range(1, layers + 1):
        if sparse == [i for i in range(layers) if (i + 1) % freq == 0]:
            return freq
    raise ValueError(
        f"mlp_only_layers {only} with decoder_sparse_step {step} leaves experts on layers "
        f"{sparse}, not on every k-th layer; set mlp_only_layers to [] and choose the "
        "expert layers by decoder_sparse_step"
    )


def config_items(cfg: ModelConfig, kind: str, base: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` entries of ``cfg``'s experts for ``kind`` (on top of ``base``,
    the imported original: its ``router_aux_loss_coef`` stays when the loss is off)."""
    items = layout.config_items(cfg, KEYS[kind], base)
    coeff = cfg.moe_aux_loss_coeff
    items["output_router_logits"] = coeff > 0
    items["router_aux_loss_coef"] = coeff if coeff > 0 else base.get("router_aux_loss_coef", 0.0)
    if kind in ("qwen2_moe", "qwen3_moe"):
        items["mlp_only_layers"] = []
    if kind == "qwen3_moe" and _QWEN3_EXPERTS[1] in base:  # the spelling it was read in
        items[_QWEN3_EXPERTS[1]] = items.pop(_QWEN3_EXPERTS[0])
    return items


def _experts_to_ours(experts: int) -> Transform:
    """E gate, E up and E down ``nn.Linear`` weights ↔ ``experts.fc1`` and ``experts.fc2``."""

    def to_ours(*tensors):
        gates, ups, downs = (
            tensors[:experts],
            tensors[experts : 2 * experts],
            tensors[2 * experts :],
        )
        fc1 = torch.stack(
            [layout.interleave_rows((g, u), None).t() for g, u in zip(gates, ups, strict=True)]
        )
        return fc1, torch.stack([d.t() for d in downs])

    def to_hf(fc1, fc2):
        pairs = [layout.split_rows(w.t(), None, 2) for w in fc1]
        gates, ups = (tuple(p[j] for p in pairs) for j in (0, 1))
        return (*gates, *ups, *(w.t() for w in fc2))

    return Transform(to_ours, to_hf)


def expert_rows(cfg: ModelConfig, ours: str, theirs: str) -> list[Weights]:
    """One MoE layer's rows: meshtron's ``{ours}.router`` / ``.experts`` / ``.shared_*``
    ↔ the HF names under layer prefix ``theirs`` (``model.layers.{i}``)."""
    kind = moe_kind(cfg)
    block = f"{theirs}.{_PREFIX[kind]}"
    names = [
        f"{block}.experts.{e}.{part}.weight"
        for part in _EXPERT_NAMES[kind]
        for e in range(cfg.moe_num_experts)
    ]
    rows = [
        rename(f"{ours}.router.weight", f"{block}.gate.weight"),
        Weights(
            (f"{ours}.experts.fc1", f"{ours}.experts.fc2"),
            tuple(names),
            _experts_to_ours(cfg.moe_num_experts),
        ),
    ]
    if kind == "qwen2_moe":
        shared = f"{block}.shared_expert"
        rows += [
            rename(f"{ours}.shared_gate", f"{block}.shared_expert_gate.weight"),
            rename(f"{ours}.shared_expert.fc2.weight", f"{shared}.down_proj.weight"),
            Weights(
                (f"{ours}.shared_expert.fc1.weight",),
                (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                layout.interleaved(None, 2),
            ),
        ]
    return rows


# transformers' in-memory (fused) expert tensors: gate_up_proj [E, 2f, h] (gates, then
# ups), down_proj [E, h, f]; Mixtral's modules also sit under "mlp", not "block_sparse_moe".
_FUSED = re.compile(
    r"(model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)"
)


def unfused(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` with any fused expert tensors (a state dict of transformers' modules) split into
    the per-expert tensors ``save_pretrained`` writes; everything else as it is."""
    kind = moe_kind(cfg)
    gate, up, down = _EXPERT_NAMES[kind]
    out = {}
    for name, tensor in hf.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        block = f"{match[1]}.{_PREFIX[kind]}"
        if match[2] == "gate.weight":
            out[f"{block}.gate.weight"] = tensor
        elif match[2] == "experts.down_proj":
            out.update({f"{block}.experts.{e}.{down}.weight": w for e, w in enumerate(tensor)})
        else:
            for e, w in enumerate(tensor):
                first, second = w.chunk(2)
                out[f"{block}.experts.{e}.{gate}.weight"] = first
                out[f"{block}.experts.{e}.{up}.weight"] = second
    return out
