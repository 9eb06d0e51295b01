"""BERT: token/position/type embeddings with LayerNorm, post-LN layers, MLM and SOP heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.base import (
    ParallelLMHead,
    TransformerModel,
    hidden_layer_norm,
    replicated_linear,
    stack_batches,
    to_device,
)
from engine.models.config import ModelConfig
from layers import gather_from_tp, vocab_parallel_cross_entropy
from layers.documents import padding_mask
from layers.kernel_set import Kernels
from layers.ring_attention import cp_positions, shard_for_cp
from layers.utils import comm_timer_of


def _dense(
    cfg: ModelConfig, out_features: int, sequence_parallel: bool, dtype, device
) -> nn.Linear:
    """A replicated ``hidden_size → out_features`` linear drawn with ``cfg.init_std``;
    ``sequence_parallel`` when it runs on the sequence shard."""
    return replicated_linear(
        cfg.hidden_size,
        out_features,
        std=cfg.init_std,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        device=device,
    )


class MLMTransform(nn.Module):
    """dense → GeLU → LayerNorm before the MLM decoder; on the sequence shard under SP."""

    def __init__(self, cfg: ModelConfig, *, kernels: Kernels, dtype, device) -> None:
        super().__init__()
        self.sequence_parallel = cfg.sequence_parallel
        self.kernels = kernels
        self.approximate = {"gelu": "none", "gelu_tanh": "tanh"}[cfg.activation]
        self.dense = _dense(cfg, cfg.hidden_size, cfg.sequence_parallel, dtype, device)
        self.norm = hidden_layer_norm(cfg, kernels=kernels, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.kernels.gelu(self.dense(x), None, self.approximate))


class Pooler(nn.Module):
    """tanh(dense(hidden of [CLS])) → ``[b, h]``, replicated on every TP rank."""

    def __init__(self, cfg: ModelConfig, *, tp_group, dtype, device) -> None:
        super().__init__()
        self.tp_group, self.input_sequence_sharded = tp_group, cfg.sequence_parallel
        self.dense = _dense(cfg, cfg.hidden_size, False, dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.input_sequence_sharded:
            # [CLS] is row 0 of TP rank 0's shard. Gather every shard's first row with an
            # operator that splits (not sums) the gradient backward: each rank computes the
            # pooler redundantly, so summing would count its gradient tp_size times.
            first_rows = gather_from_tp(
                hidden[0].unsqueeze(-1), self.tp_group, comm_timer=comm_timer_of(self)
            )  # [b, h, tp]
            cls = first_rows[..., 0]
        else:
            cls = hidden[0]  # [b, h]
        return torch.tanh(self.dense(cls))


class BertModel(TransformerModel):
    """BERT for pre-training: masked-LM logits (vocab-sharded) and a sentence-order head.

    ``forward(input_ids, token_type_ids, attention_mask)`` with ``[b, s]`` inputs
    (attention_mask 1 for real tokens) returns ``{"mlm_logits": [b, s, V_padded/tp],
    "sop_logits": [b, 2]}``; given ``mlm_labels`` (-100 = not masked) and/or
    ``sop_labels``, also ``loss`` = mean MLM loss over labelled tokens + SOP cross-entropy,
    with its parts ``mlm_loss`` and ``sop_loss``.

    Under context parallelism (:meth:`context_shard`) each cp rank holds s/cp tokens of
    every row, attends over the whole rows through the ring (bidirectional, padding keys
    hidden by a ``PaddingMask``) and weighs its losses so that their mean over the cp group
    is the unsplit model's: its MLM sum × cp / (the whole rows' labelled count), and the
    SOP loss × cp on the rank holding [CLS] (cp rank 0, whose first chunk starts the row),
    × 0 elsewhere (its pooler's input is some other token).
    """

    ARCH = "bert"
    pipeline_heads = ("mlm_transform", "lm_head", "pooler", "sop_head")

    def _build_heads(self, cfg: ModelConfig, *, tp_group, dtype, device) -> None:
        build = dict(tp_group=tp_group, dtype=dtype, device=device)
        self.mlm_transform = MLMTransform(cfg, kernels=self.kernels, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(cfg, tied=cfg.tie_embeddings, bias=True, **build)
        self.pooler = Pooler(cfg, **build)
        self.sop_head = _dense(cfg, 2, False, dtype, device)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """MLM + SOP loss of ``batch`` as BertDataset yields it: ``input_ids``,
        ``token_type_ids``, ``attention_mask``, ``mlm_labels`` ``[b, s]`` and ``sop_label``
        ``[b]``."""
        return self(
            batch["input_ids"],
            batch["token_type_ids"],
            batch["attention_mask"],
            mlm_labels=batch["mlm_labels"],
            sop_labels=batch["sop_label"],
            positions=batch.get("positions"),
            cp_weights=batch["cp_weights"][0] if "cp_weights" in batch else None,
        )["loss"]

    def context_shard(
        self, batch: dict[str, torch.Tensor], cp_size: int, cp_rank: int
    ) -> dict[str, torch.Tensor]:
        """Cp rank ``cp_rank``'s share of a BertDataset micro-batch: ids, token types and
        MLM labels cut to chunks ``cp_rank`` and ``2·cp_size−1−cp_rank`` of each row
        (``shard_for_cp``), the tokens' global ``positions``, the whole rows'
        ``attention_mask`` (the ring hides the padding keys of every rank), the SOP labels,
        and ``cp_weights`` (:func:`loss_weights`: cp, the whole rows' labelled count, and
        the SOP loss's weight, cp on cp rank 0 and 0 elsewhere), which make the cp ranks'
        mean loss the whole rows' loss."""
        b, s = batch["input_ids"].shape
        keys = ("input_ids", "token_type_ids", "mlm_labels")
        shard = {k: shard_for_cp(batch[k], cp_size, cp_rank, dim=1) for k in keys}
        device = batch["input_ids"].device
        weights = loss_weights(batch["mlm_labels"], cp_size, cp_size if cp_rank == 0 else 0)
        positions = cp_positions(s, cp_size, cp_rank, device=device).expand(b, -1)
        whole = {k: batch[k] for k in ("attention_mask", "sop_label")}
        return {**shard, **whole, "positions": positions, "cp_weights": weights}

    def logits(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"mlm_logits": [b, s, V_padded/tp], "sop_logits": [b, 2]}`` of ``batch``, at its
        ``"positions"`` where it has them (a cp rank's share, ``context_shard``)."""
        ids, types, mask = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
        out = self(ids, types, mask, positions=batch.get("positions"))
        return {"mlm_logits": out["mlm_logits"], "sop_logits": out["sop_logits"]}

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        mlm_labels: torch.Tensor | None = None,
        sop_labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cp_weights: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """``positions`` ``[b, s/cp]``: a cp rank's share (:meth:`context_shard`), whose
        ``attention_mask`` is then the whole rows' and ``cp_weights`` weigh its losses."""
        mask = padding_mask(attention_mask, ring=positions is not None)
        hidden = self.embedding(input_ids, token_type_ids, positions=positions)  # [s(/tp), b, h]
        for layer in self.layers:
            hidden = layer(hidden, mask)
        logits, sop = self.head(hidden)
        out = {"mlm_logits": logits.transpose(0, 1), "sop_logits": sop}
        return out | bert_losses(self, logits, sop, mlm_labels, sop_labels, cp_weights)

    # The pipeline cut's hooks (ParallelModel): a stage runs them on itself. The padding
    # mask is no activation: every stage gets its micro-batch's mask as a keyword input.

    def embed(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The first stage's hidden ``[s(/tp), b, h]`` of ids and token types ``[b, s]`` (at
        ``positions``, a cp rank's global ones, else 0 … s−1)."""
        return self.embedding(input_ids, token_type_ids, positions=positions)

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLM logits ``[s, b, V/tp]`` (vocab-sharded) and the sentence-order logits
        ``[b, 2]`` of the final hidden."""
        word = self.embedding.word.weight if self.cfg.tie_embeddings else None
        return self.lm_head(self.mlm_transform(hidden), word), self.sop_head(self.pooler(hidden))

    def stage_inputs(self, micro_batches: list, device: torch.device) -> tuple:
        """BertDataset's dicts (or a cp rank's shares of them, :meth:`context_shard`): ids
        and token types go to the first stage, the padding mask (and a cp rank's global
        ``positions``) to every stage; the target is the MLM labels, then the SOP label,
        then the micro-batch's three :func:`loss_weights` columns (the schedule splits one
        target tensor, each micro-batch's rows carrying its own weights)."""
        moved = [to_device(m, device) for m in micro_batches]
        # Without cp: cp 1, the micro-batch's own count, weight 1 (a cp share has its own).
        batch = stack_batches(
            [{"cp_weights": loss_weights(m["mlm_labels"], 1, 1), **m} for m in moved]
        )
        labels = (batch["mlm_labels"], batch["sop_label"][:, None], batch["cp_weights"])
        keywords = {"attention_mask": batch["attention_mask"]}
        if "positions" in batch:
            keywords["positions"] = batch["positions"]
        return (batch["input_ids"], batch["token_type_ids"]), keywords, torch.cat(labels, dim=1)

    def stage_loss(self, outputs: tuple, target: torch.Tensor) -> torch.Tensor:
        """MLM + SOP loss of the :meth:`head` outputs against the :meth:`stage_inputs`
        target (MLM labels ``[b, s]``, the SOP label, the three weight columns)."""
        mlm, sop = outputs
        labels, weights = target[:, :-4], target[0, -3:]
        return bert_losses(self, mlm, sop, labels, target[:, -4], weights)["loss"]


def bert_losses(
    module: nn.Module,
    mlm_logits: torch.Tensor,
    sop_logits: torch.Tensor,
    mlm_labels: torch.Tensor | None = None,
    sop_labels: torch.Tensor | None = None,
    cp_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``mlm_loss`` (mean over the labelled tokens) of ``mlm_logits`` ``[s, b, V/tp]``
    against ``mlm_labels`` ``[b, s]`` (-100 = not masked), ``sop_loss`` of ``sop_logits``
    ``[b, 2]`` against ``sop_labels`` ``[b]``, and their sum ``loss`` (those given), with
    ``module``'s vocabulary and TP group (the whole BERT, or a pipeline's last stage).
    ``cp_weights`` (:func:`loss_weights`: cp, a labelled count, the SOP weight) make the MLM
    loss the sum × cp / that count and weigh the SOP loss (a cp rank's share, or a pipeline
    micro-batch's: cp 1, its own count, weight 1, which is the plain mean exactly)."""
    out = {}
    if mlm_labels is not None:
        per_token = vocab_parallel_cross_entropy(
            mlm_logits,
            mlm_labels.t(),
            vocab_size=module.cfg.vocab_size,
            tp_group=module.tp_group,
            comm_timer=comm_timer_of(module),
        )
        if cp_weights is None:
            labelled = (mlm_labels != -100).sum().clamp(min=1)
            out["mlm_loss"] = per_token.sum() / labelled
        else:  # × 1 is exact: at cp 1 this is the mean above, bit for bit
            out["mlm_loss"] = per_token.sum() * cp_weights[0] / cp_weights[1].clamp(min=1)
    if sop_labels is not None:
        sop = sop_logits.to(torch.promote_types(sop_logits.dtype, torch.float32))
        out["sop_loss"] = F.cross_entropy(sop, sop_labels)
        if cp_weights is not None:
            out["sop_loss"] = out["sop_loss"] * cp_weights[2]
    if out:
        out["loss"] = sum(out.values())
    return out


def loss_weights(mlm_labels: torch.Tensor, cp_size: int, sop_weight: int) -> torch.Tensor:
    """``[b, 3]`` int64, each row (cp, the labelled count of all of ``mlm_labels`` ``[b, s]``,
    the SOP loss's weight): what :func:`bert_losses` weighs a rank's losses by. A row each,
    so that a pipeline schedule splitting the target by rows hands every micro-batch its own."""
    labelled = (mlm_labels != -100).sum()
    row = torch.stack((labelled.new_tensor(cp_size), labelled, labelled.new_tensor(sop_weight)))
    return row.expand(mlm_labels.shape[0], 3)
