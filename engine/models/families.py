"""The model families ``model.arch`` names, and where each family's parts live.

A family is a folder ``engine/models/<arch>/``: ``model.py`` (its class, built from the
component seams in ``layers/``), ``hf.py`` (its Hugging Face config and weight names),
``costs.py`` (its FLOP and parameter terms); its presets are ``configs/model/*.yaml``.
This table is the one list of them: ``build_model``, ``engine.hf_interop`` and
``engine.flops`` look a family up here instead of asking which one it is, and the config
reads the traits that the layers and the data take from the family.

The table imports nothing of ours, because the config reads it and every family module
imports the config: a family's modules are imported when first asked for. Neither this
table nor its package's ``__init__`` imports torch, so the torch-free performance model
reads it too (``studies/perfmodel/family_table.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

# The end-of-document token engine.data.preprocess appends (kept literal: the table imports
# nothing of ours).
_DOCUMENT_END = "<|endoftext|>"


@dataclass(frozen=True)
class Family:
    """One family: its folder's name, its model class and its traits."""

    arch: str  # the model.arch value, and the folder engine/models/<arch>/
    model: str  # the class in the folder's model.py
    causal: bool = True  # a decoder: causal attention, next-token data, generation
    pre_norm: bool = True  # sub-layers normalize their input (post-norm: the residual sum)
    token_types: bool = False  # segment embeddings and a LayerNorm on the embeddings
    gated_mlp: bool = False  # a gated MLP (SwiGLU's three matrices), as the planner prices it
    hf_experts: bool = False  # its Hugging Face map writes MoE layers (model.mlp=moe)
    # A Hugging Face export's special-token roles ("eos_token": ...), each with its tokens
    # in preference order: the first one the exported tokenizer's vocabulary holds.
    special_tokens: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def module(self, part: str) -> ModuleType:
        """The folder's ``model``, ``hf`` or ``costs`` module."""
        return importlib.import_module(f"engine.models.{self.arch}.{part}")

    def model_class(self) -> type:
        """The class ``build_model`` builds for this family."""
        return getattr(self.module("model"), self.model)

    @property
    def hf(self) -> ModuleType:
        """The Hugging Face map: ``ARCHITECTURES`` (config.json ``model_type`` → class
        name), ``config_from_hf``, ``config_to_hf``, ``state_from_hf``, ``state_to_hf``."""
        return self.module("hf")

    @property
    def costs(self) -> ModuleType:
        """``model_flops(cfg, batch, seq, vocab=, recompute=)``, ``params_count(cfg)`` and
        ``layer_activation_bytes(cfg, seq_len=, batch_size=, tp_size=)``."""
        return self.module("costs")


FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family(
            "gpt",
            "GPTModel",
            special_tokens={
                "bos_token": (_DOCUMENT_END,),
                "eos_token": (_DOCUMENT_END,),
                "unk_token": (_DOCUMENT_END,),
            },
        ),
        Family(
            "bert",
            "BertModel",
            causal=False,
            pre_norm=False,
            token_types=True,
            special_tokens={
                "pad_token": ("[PAD]",),
                "cls_token": ("[CLS]",),
                "sep_token": ("[SEP]",),
                "mask_token": ("[MASK]",),
            },
        ),
        Family(
            "llama",
            "LlamaModel",
            gated_mlp=True,
            hf_experts=True,  # Mixtral, Qwen2-MoE, Qwen3-MoE (llama/moe_hf.py)
            # Llama 2's and Llama 3's own tokens first (an imported tokenizer), then the
            # document end of a tokenizer trained here.
            special_tokens={
                "bos_token": ("<s>", "<|begin_of_text|>", _DOCUMENT_END),
                "eos_token": ("</s>", "<|end_of_text|>", _DOCUMENT_END),
            },
        ),
        Family(
            "gemma",
            "Gemma2Model",
            gated_mlp=True,
            special_tokens={
                "bos_token": ("<bos>", _DOCUMENT_END),
                "eos_token": ("<eos>", _DOCUMENT_END),
            },
        ),
    )
}


def family(arch: str) -> Family:
    """The family ``arch`` names; a one-line error naming the known ones otherwise."""
    if arch not in FAMILIES:
        raise ValueError(f"model.arch={arch!r} is not one of {tuple(FAMILIES)}")
    return FAMILIES[arch]


def decoders() -> str:
    """The families that generate (causal ones), as a sentence lists them: "gpt, llama, gemma"."""
    return ", ".join(arch for arch, f in FAMILIES.items() if f.causal)
