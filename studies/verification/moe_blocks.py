"""transformers' sparse-MoE blocks (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock``) in ``layers.moe.MoEMLP``'s names and layouts, so one layer can
be run on the other's weights: by the MoE tests (outputs and gradients compared) and by
the MoE benchmark (the same layer timed both ways).

The in-memory tensors of transformers' modules, not the per-expert files of
``save_pretrained`` (``engine/models/llama/moe_hf.py`` maps those).
"""

from __future__ import annotations

import torch
from torch import nn


def block_to_ours(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' block tensors (weights or gradients) in our names and layouts: expert
    weights ``[E, out, in]`` → ``[E, in, out]``, gate/up concatenated → interleaved."""
    gate, up = hf["experts.gate_up_proj"].chunk(2, dim=1)  # each [E, f, h]
    ours = {
        "router.weight": hf["gate.weight"],
        "experts.fc1": torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2),
        "experts.fc2": hf["experts.down_proj"].transpose(1, 2),
    }
    if "shared_expert.gate_proj.weight" in hf:
        gate, up = hf["shared_expert.gate_proj.weight"], hf["shared_expert.up_proj.weight"]
        ours["shared_expert.fc1.weight"] = torch.stack((gate, up), dim=1).flatten(0, 1)
        ours["shared_expert.fc2.weight"] = hf["shared_expert.down_proj.weight"]
        ours["shared_gate"] = hf["shared_expert_gate.weight"]
    return ours


def copy_block_weights(moe: nn.Module, block: nn.Module) -> None:
    """Set every parameter of ``moe`` (a ``MoEMLP``) to ``block``'s, which must cover
    exactly the same set."""
    state = block_to_ours(dict(block.named_parameters()))
    names = {name for name, _ in moe.named_parameters()}
    if set(state) != names:
        raise ValueError(f"parameters differ: ours {sorted(names)}, block's {sorted(state)}")
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(state[name])
