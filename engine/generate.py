"""Sampling text from a GPT whose logits are sharded over the vocabulary across TP."""

from __future__ import annotations

import torch

from layers.mappings import gather_from_tp
from layers.utils import group_size


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """Sample ``max_new_tokens`` ids after ``prompt_ids`` with temperature and top-k.

    Works at any TP layout: the last position's logit shards are gathered (one vocabulary
    row per step), and every TP rank samples with an identically seeded generator from
    identical logits, so all ranks produce the same tokens with no extra broadcast.
    Padding columns of the vocabulary are never sampled.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    window = model.cfg.max_positions
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], device=device)
        if model.cfg.sequence_parallel:
            context = _pad_to_multiple(context, group_size(model.tp_group))
        logits = gather_from_tp(model(context)[:, len(ids[-window:]) - 1], model.tp_group)
        logits = logits[0, : model.cfg.vocab_size].float().cpu() / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    model.train(was_training)
    return ids


def _pad_to_multiple(context: torch.Tensor, multiple: int) -> torch.Tensor:
    """Right-pad so sequence parallelism can split the sequence; causal attention ignores it."""
    pad = -context.shape[1] % multiple
    return torch.nn.functional.pad(context, (0, pad)) if pad else context
