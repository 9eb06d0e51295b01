"""Sampling text from a GPT whose logits are sharded over the vocabulary across TP.

Prompts of different lengths run as one batch, left-padded: an attention mask hides the
padding and each sequence's positions start at its first real token, so a prompt gets the
same continuation alone or in a batch. With the KV cache (default) the prompt is encoded
once and every further step feeds one token per sequence; without it every step re-encodes
the whole context (the reference the cache is tested against, and the baseline of
docs/BENCHMARKS.md).

Every TP rank gathers the same last-position logits and samples with an identically
seeded generator, so all ranks produce the same tokens with no extra broadcast. Padding
columns of the vocabulary are never sampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layers.mappings import gather_from_tp
from parallel_state.groups import group_size

PAD_ID = 0  # any valid id: padded positions are masked out and never read


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits."""

    greedy: bool = False  # argmax; the other fields are ignored
    temperature: float = 1.0  # logits are divided by this (> 0)
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p (nucleus); 1: all
    seed: int = 0  # seed of the sampling generator (the same on every rank)

    def check(self) -> None:
        """Raise ValueError naming the bad value (nan and inf included)."""
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed <= 2**64 - 1:  # torch.Generator.manual_seed's range, as uint64
            raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {self.seed}")


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator):
    """``[b, V]`` float logits → ``[b]`` ids, by argmax or by sampling after the filters."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    # Shift the largest logit to 0 and divide in float64: a tiny temperature (any float > 0)
    # then sends the others towards -inf, greedy in the limit, where float32 logits divided
    # by it overflowed (or met 0 / 0) and the sampler raised on nan probabilities.
    logits = (logits - logits.max(dim=-1, keepdim=True).values).double() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the more likely ones already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    use_cache: bool = True,
    stop: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """The new ids of each prompt (at most ``max_new_tokens``; fewer once ``stop(row,
    new_ids)`` says so). Beyond ``max_positions`` the context window slides (no cache then)."""
    sampling.check()
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    was_training = model.training
    model.eval()
    try:
        # A model compiled for training (model.compile) decodes eagerly: every step's new
        # cache length and the switch from the whole prompt to one token would each
        # compile the forward again (the quick-start model's closing sample, compiled,
        # recompiled it twice on each rank).
        with torch.compiler.set_stance("force_eager"):
            return _decode(model, prompts, max_new_tokens, sampling, use_cache, stop)
    finally:
        model.train(was_training)


def _decode(model, prompts, max_new_tokens, sampling, use_cache, stop) -> list[list[int]]:
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    width, window = max(map(len, prompts)), model.cfg.max_positions
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts], device=device)
    valid = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # A one-token step cannot be split over the sequence: SP models re-encode every step.
    cache = None
    if use_cache and not model.cfg.sequence_parallel and width < window:
        cache = model.new_cache(len(prompts), min(width + max_new_tokens, window))
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    fed = 0  # columns of ``ids`` already in the cache
    for _ in range(max_new_tokens):
        if cache is not None and cache[0].length + ids.shape[1] - fed > cache[0].capacity:
            cache = None  # full: slide the window by re-encoding from here on
        if cache is not None:
            logits = _forward(model, ids[:, fed:], valid, cache)
            fed = ids.shape[1]
        else:
            logits = _forward(model, ids[:, -window:], valid[:, -window:], None)
        token = next_tokens(logits, sampling, generator).to(device)
        ids = torch.cat([ids, token[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        for row, t in enumerate(token.tolist()):
            if not done[row]:
                new[row].append(t)
                done[row] = stop is not None and stop(row, new[row])
        if all(done):
            break
    return new


def _forward(model, ids: torch.Tensor, valid: torch.Tensor, cache) -> torch.Tensor:
    """Last-position logits ``[b, V]`` (float32, CPU) of ``ids`` after the cached past."""
    past, n = (cache[0].length if cache else 0), ids.shape[1]
    # Positions count real tokens only, so left padding does not shift a prompt.
    positions = (valid.cumsum(dim=1) - 1).clamp(min=0)[:, past : past + n]
    key_mask = valid[:, : past + n]
    if model.cfg.sequence_parallel:
        # Right-pad so sequence parallelism can split the sequence; causality hides the pad.
        pad = -n % group_size(model.tp_group)
        ids, key_mask, positions = (F.pad(t, (0, pad)) for t in (ids, key_mask, positions))
    logits = model(ids, attention_mask=key_mask, positions=positions, cache=cache)
    return gather_from_tp(logits[:, n - 1], model.tp_group)[:, : model.cfg.vocab_size].float().cpu()


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    use_cache: bool = True,
) -> list[int]:
    """``prompt_ids`` followed by ``max_new_tokens`` sampled ids (temperature and top-k)."""
    sampling = Sampling(temperature=temperature, top_k=top_k, seed=seed)
    return (
        list(prompt_ids)
        + generate_batch(model, [list(prompt_ids)], max_new_tokens, sampling, use_cache=use_cache)[
            0
        ]
    )


def sample_text(model, tokenizer, t) -> str:
    """The trainer's closing sample: ``t.sample_prompt`` and ``t.sample_tokens`` more, as
    text (``t``: the trainer config, whose seed, temperature and top-k it samples with)."""
    prompt = tokenizer.encode(t.sample_prompt).ids
    ids = generate(
        model,
        prompt,
        t.sample_tokens,
        temperature=t.sample_temperature,
        top_k=t.sample_top_k,
        seed=t.seed,
    )
    return tokenizer.decode(ids)
