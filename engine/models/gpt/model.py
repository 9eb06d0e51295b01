"""The decoder: GPT-2's layout (learned positions, pre-LN, final LayerNorm, tied LM head),
and through the config's component seams the Llama family's (rotary, RMSNorm, SwiGLU, GQA)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.base import ParallelLMHead, TransformerModel, stack_batches, to_device
from engine.models.config import ModelConfig
from layers.attention import KVCache, decoder_mask
from layers.documents import DocumentMask, document_positions
from layers.norm import make_norm
from layers.ring_attention import cp_positions, shard_for_cp
from layers.rotary import inverse_frequencies, rotary_tables
from layers.utils import comm_timer_of
from parallel_state.groups import group_size


class GPTModel(TransformerModel):
    """A causal language model whose logits stay sharded over the vocabulary across TP.

    ``forward(input_ids [b, s])`` → logits ``[b, s, V_padded/tp]`` (this rank's vocabulary
    block); with ``labels [b, s]`` → per-token loss ``[b, s]`` (padding columns excluded,
    label -100 ignored). The vocabulary is never gathered.
    """

    ARCH = "gpt"  # the model.arch this class builds (a family's subclass names its own)
    pipeline_heads = ("final_norm", "lm_head")

    def _build_heads(self, cfg: ModelConfig, *, tp_group, dtype, device) -> None:
        self.final_norm = make_norm(cfg, kernels=self.kernels, dtype=dtype, device=device)
        if self.rotary:  # fp32 frequencies, a buffer so .to(device) moves them
            inv = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_args)
            self.register_buffer("inv_freq", inv.to(device), persistent=False)
        self.lm_head = ParallelLMHead(
            cfg, tied=cfg.tie_embeddings, bias=False, tp_group=tp_group, dtype=dtype, device=device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: list[KVCache] | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Generation passes ``attention_mask`` (``[b, past + s]``, False at left padding),
        ``positions`` (``[b, s]``) and ``cache`` (one KVCache per layer, from ``new_cache``).
        Training on packed documents passes ``document_ids`` (``[b, s]``, the whole rows'
        under cp): attention stays within each document and, unless ``positions`` are
        given, positions restart at each document start (``layers.documents``)."""
        mask = None
        if document_ids is not None:
            if attention_mask is not None or cache is not None:
                raise ValueError("document_ids are for training: no attention_mask or cache")
            if positions is None:
                positions = document_positions(document_ids)
            mask = DocumentMask(document_ids)
        hidden = self.embedding(input_ids, positions=positions)  # [s, b, h]; [s/tp, b, h] SP
        if attention_mask is not None:
            b, s = input_ids.shape
            past = cache[0].length if cache else 0
            mask = decoder_mask(attention_mask, s, past, batch=b, device=input_ids.device)
        rotary = self._rotary_tables(input_ids, positions, cache, hidden.dtype)
        for i, layer in enumerate(self.layers):
            if rotary is None:
                hidden = layer(hidden, mask, cache[i] if cache else None)
            else:
                hidden = layer(hidden, mask, cache[i] if cache else None, rotary)
        logits = self.head(hidden)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)  # [b, s, V/tp]
        return vocab_parallel_losses(self, logits, labels)

    def _rotary_tables(self, input_ids, positions, cache, dtype):
        """(cos, sin) ``[b, 1, s, d]`` for rotary models (positions default to past … past+s−1)."""
        if not self.rotary:
            return None
        if positions is None:
            past = cache[0].length if cache else 0
            seq = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
            positions = seq.expand(input_ids.shape[0], -1)
        return rotary_tables(self.inv_freq, positions, dtype)

    def loss(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss of ``batch``: token windows ``[b, s+1]`` (as GPTDataset yields
        them; position i predicts i+1), or ``{"input_ids", "labels"}``, each ``[b, s]``,
        with ``"positions"`` ``[b, s]`` where they are not 0 … s−1 (a cp rank's share) and
        ``"document_ids"`` of packed documents (``data.document_mask``). Every token keeps
        its label, the next token of the window, also the last token of a document, whose
        label is the next document's first token (as Megatron-LM without eod_mask_loss)."""
        batch = next_token_pairs(batch)
        return self(
            batch["input_ids"],
            batch["labels"],
            positions=batch.get("positions"),
            document_ids=batch.get("document_ids"),
        ).mean()

    def context_shard(
        self, batch: torch.Tensor | dict[str, torch.Tensor], cp_size: int, cp_rank: int
    ) -> dict[str, torch.Tensor]:
        """``{"input_ids", "labels", "positions"}`` of cp rank ``cp_rank``: chunks ``cp_rank``
        and ``2·cp_size−1−cp_rank`` of each row (``shard_for_cp``), labels cut as the ids
        they follow, and the tokens' global positions for RoPE or the position table. With
        ``"document_ids"`` (packed documents) the positions are those within each document
        and the whole rows' ids go along: the ring cuts its blocks from them."""
        pairs = next_token_pairs(batch)
        b, s = pairs["input_ids"].shape
        shard = {
            k: shard_for_cp(pairs[k], cp_size, cp_rank, dim=1) for k in ("input_ids", "labels")
        }
        documents = pairs.get("document_ids")
        if documents is not None:
            positions = shard_for_cp(document_positions(documents), cp_size, cp_rank, dim=1)
            return {**shard, "positions": positions, "document_ids": documents}
        positions = cp_positions(s, cp_size, cp_rank, device=pairs["input_ids"].device)
        return {**shard, "positions": positions.expand(b, -1)}

    # The pipeline cut's hooks (ParallelModel): a stage runs them on itself.

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The first stage's hidden ``[s(/tp), b, h]`` of ids ``[b, s]`` (at ``positions``
        ``[b, s]``, a cp rank's global ones, else 0 … s−1)."""
        return self.embedding(input_ids, positions=positions)

    def rotary_for(
        self, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) for ``positions`` ``[b, s]`` (a cp rank's global ones), else for
        positions 0 … s−1 of ``hidden`` (a sequence shard under SP)."""
        if not self.rotary:
            return None
        if positions is None:
            tp = group_size(self.tp_group) if self.cfg.sequence_parallel else 1
            seq = torch.arange(hidden.shape[0] * tp, device=hidden.device)
            positions = seq.expand(hidden.shape[1], -1)
        return rotary_tables(self.inv_freq, positions, hidden.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-sharded logits ``[s, b, V/tp]`` of the final hidden (norm, LM head, and
        ``cfg.final_logit_softcapping``'s c·tanh(logits/c) where it is set)."""
        word = self.embedding.word.weight if self.cfg.tie_embeddings else None
        logits = self.lm_head(self.final_norm(hidden), word)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def stage_inputs(self, micro_batches: list, device: torch.device) -> tuple:
        """Token windows ``[b, s+1]`` or ``{"input_ids", "labels"}``: the ids go to the first
        stage, the labels are the target. A cp rank's share (:meth:`context_shard`) also
        has ``"positions"``, its tokens' global ones, and packed rows (``data.document_mask``)
        ``"document_ids"``: keyword inputs of every stage (the first embeds at the
        positions, every stage rotates at them and masks attention by the documents)."""
        batch = stack_batches([next_token_pairs(to_device(m, device)) for m in micro_batches])
        keywords = {k: batch[k] for k in ("positions", "document_ids") if k in batch}
        return (batch["input_ids"],), keywords, batch["labels"]

    def stage_loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of the logits ``[s, b, V/tp]`` against labels ``[b, s]``."""
        return vocab_parallel_losses(self, outputs, target).mean()

    def logits(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"logits": [b, s, V_padded/tp]}`` of ``batch["input_ids"]`` (vocab-sharded), at
        ``"positions"`` and within ``"document_ids"`` where the batch has them (a cp rank's
        share, ``context_shard``)."""
        return {
            "logits": self(
                batch["input_ids"],
                positions=batch.get("positions"),
                document_ids=batch.get("document_ids"),
            )
        }

    def new_cache(self, batch: int, capacity: int) -> list[KVCache]:
        """Empty KV caches (one per layer, this rank's heads) for ``batch`` sequences of up to
        ``capacity`` positions."""
        return [layer.attention.new_cache(batch, capacity) for layer in self.layers]


def next_token_pairs(batch: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}`` of a batch: token windows ``[b, s+1]`` are split (position
    i predicts i+1); a dict is returned as it is."""
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch[:, :-1], "labels": batch[:, 1:]}
    return batch


def vocab_parallel_losses(
    module: nn.Module, logits: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of ``logits`` ``[s, b, V/tp]`` against ``labels``
    ``[b, s]``, with ``module``'s kernels, vocabulary and TP group (the whole model, or a
    pipeline's last stage). The logits are consumed: a fused kernel may overwrite them
    with their gradient."""
    loss = module.kernels.cross_entropy(
        logits,
        labels.t(),
        vocab_size=module.cfg.vocab_size,
        tp_group=module.tp_group,
        comm_timer=comm_timer_of(module),
    )
    return loss.t()
