"""Pieces the model families share: embeddings, the vocab-parallel LM head, full-weight I/O.

Every parameter is built from the default (replicated) RNG stream at full size and then
sliced, in the same order at every TP size, so a model's full weights depend only on the
seed. The vocabulary is padded at build time (to a multiple of tp_size × 128) but the
padding never leaves the model: full state dicts hold exactly ``vocab_size`` rows.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.families import family
from layers import VocabParallelEmbedding, scatter_to_sequence
from layers.compile import compile_model
from layers.dropout import dropout
from layers.gqa import dedupe_gathered, owned_block
from layers.kernel_set import Kernels, resolve_kernels
from layers.linear import (
    InitMethod,
    build_master_weight,
    linear_after_copy,
    normal_init,
    replicated_weight,
    sequence_parallel_linear,
)
from layers.mappings import gather_along
from layers.norm import LayerNorm
from layers.param_roles import (
    expert_rank,
    expert_split,
    is_vocab_padded,
    mark_sp_partial_grad,
    mark_tp_dim,
    mark_vocab_padded,
    replicas,
    tp_dim,
)
from layers.recompute import default_rng
from layers.router import BIAS_KEY, load_router_biases, sigmoid_routers
from layers.spec import spec_for
from layers.transformer import ParallelTransformerLayer
from layers.utils import assign_tp_local_, comm_timer_of, shard, tp_local
from parallel_state.groups import group_rank, group_size, resolve_tp_group
from parallel_state.random import RNGTracker

# Set on parameters whose dim 0 is the padded vocabulary: trimmed to vocab_size in full
# state dicts, zero-padded again on load.


def to_device(batch, device: torch.device):
    """Move a batch (what ``ParallelModel.loss`` takes: a tensor or a dict of tensors) to ``device``."""
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


def stack_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dict batches concatenated key by key along dim 0, in order (micro-batches into the
    whole batch a pipeline schedule splits again)."""
    stacked: dict[str, list[torch.Tensor]] = {}
    for batch in batches:
        for key, value in batch.items():
            stacked.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in stacked.items()}


def unpadded_normal_init(vocab_size: int, std: float) -> InitMethod:
    """N(0, std²) for the real vocabulary rows, zeros for the padding.

    Only ``vocab_size`` rows are drawn, so the RNG stream advances by the same amount
    whatever padding the TP size implies.
    """

    def init(full: torch.Tensor) -> None:
        full.zero_()
        full[:vocab_size].normal_(0.0, std)

    return init


def replicated_linear(
    in_features: int, out_features: int, *, std: float, sequence_parallel: bool, dtype, device
) -> nn.Linear:
    """An nn.Linear held whole on every TP rank, drawn like the parallel layers' weights.

    ``sequence_parallel=True`` when it runs on a sequence shard: its gradients are partial.
    """
    device = device if device is not None else torch.get_default_device()
    # skip_init: no throwaway default-init draws from the RNG stream.
    layer = torch.nn.utils.skip_init(
        nn.Linear, in_features, out_features, dtype=dtype, device=device
    )
    with torch.no_grad():
        full = build_master_weight(
            (out_features, in_features), normal_init(std), layer.weight.dtype
        )
        layer.weight.copy_(full)
        layer.bias.zero_()
    layer.sequence_parallel = sequence_parallel  # its output is a sequence shard too
    for p in layer.parameters():
        mark_tp_dim(p, None)
        mark_sp_partial_grad(p, sequence_parallel)
    return layer


def hidden_layer_norm(cfg: ModelConfig, *, kernels: Kernels, dtype, device) -> LayerNorm:
    """A LayerNorm over ``cfg.hidden_size`` whatever ``cfg.norm`` names (the norms BERT's
    layout fixes: after the embeddings and in the MLM transform), on the sequence shard
    under SP."""
    return LayerNorm(
        cfg.hidden_size,
        cfg.layernorm_eps,
        sequence_parallel=cfg.sequence_parallel,
        kernels=kernels,
        dtype=dtype,
        device=device,
    )


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (no tensor: models are built on meta too)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class Embeddings(nn.Module):
    """Word (vocab-parallel) + position (+ token-type) embeddings, (LayerNorm), dropout.

    ``[b, s]`` ids in, ``[s, b, h]`` out, or this rank's ``[s/tp, b, h]`` shard under
    sequence parallelism. Families with token types (BERT) also get the embedding LayerNorm.
    """

    def __init__(
        self, cfg: ModelConfig, *, tp_group, rng: RNGTracker | None, kernels: Kernels, dtype, device
    ):
        super().__init__()
        self.tp_group, self.rng = tp_group, rng
        self.sequence_parallel, self.dropout = cfg.sequence_parallel, cfg.hidden_dropout
        self.word = VocabParallelEmbedding(
            cfg.padded_vocab_size(group_size(tp_group)),
            cfg.hidden_size,
            tp_group=tp_group,
            init_method=unpadded_normal_init(cfg.vocab_size, cfg.init_std),
            sequence_parallel=cfg.sequence_parallel,
            dtype=dtype,
            device=device,
        )
        mark_vocab_padded(self.word.weight)
        # Gemma: the words × sqrt(h), that factor rounded to fp32 first (as its released
        # models' normalizer is), then to the activations' dtype.
        self.scale = _fp32(cfg.hidden_size**0.5) if cfg.embedding_scale else None
        self.position = None  # rotary positions live in attention
        if cfg.position_embedding == "learned":
            self.position = self._replicated(cfg.max_positions, cfg, dtype, device)
        token_types = family(cfg.arch).token_types
        self.token_type = (
            self._replicated(cfg.num_token_types, cfg, dtype, device) if token_types else None
        )
        self.norm = None
        if token_types:
            self.norm = hidden_layer_norm(cfg, kernels=kernels, dtype=dtype, device=device)

    @staticmethod
    def _replicated(rows: int, cfg: ModelConfig, dtype, device) -> nn.Parameter:
        return replicated_weight((rows, cfg.hidden_size), cfg.init_std, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ):
        """``positions`` ``[b, s]``: each token's position (generation with left padding or
        a KV cache); default 0 … s−1."""
        words = self.word(input_ids.t())  # [s(/tp), b, h]: reduce-scattered under SP
        if self.scale is not None:
            words = words * torch.tensor(self.scale, dtype=words.dtype, device=words.device)
        if self.position is None:
            return self._dropout(words)
        seq = input_ids.shape[1]
        # Given positions are read on the host (a sync) only when eager: a compiled graph
        # takes them as the layout computed them (cp shares, packed documents: < seq).
        checked = positions is None or not torch.compiler.is_compiling()
        last = seq - 1 if positions is None else int(positions.max()) if checked else -1
        if last >= self.position.shape[0]:
            raise ValueError(f"position {last} exceeds max_positions {self.position.shape[0]} - 1")
        if positions is None:
            extra = self.position[:seq].unsqueeze(1)  # [s, 1, h], same on every TP rank
        else:
            extra = F.embedding(positions.t(), self.position)  # [s, b, h]
        if self.token_type is not None:
            if token_type_ids is None:  # a single segment
                token_type_ids = torch.zeros_like(input_ids)
            extra = extra + F.embedding(token_type_ids.t(), self.token_type)  # [s, b, h]
        if self.sequence_parallel:
            # Keep this rank's rows; backward all-gathers so the replicated tables get the
            # gradient of every position, on every rank.
            extra = scatter_to_sequence(extra, self.tp_group, comm_timer=comm_timer_of(self))
        x = words + extra
        if self.norm is not None:
            x = self.norm(x)
        return self._dropout(x)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Sequence-sharded under SP, replicated across TP otherwise.
        return dropout(x, self.dropout, self.training, rng=self.rng, sharded=self.sequence_parallel)


class ParallelLMHead(nn.Module):
    """Hidden ``[s(/tp), b, h]`` → vocab-sharded logits ``[s, b, V_padded/tp]``.

    The input enters the TP region through f (copy), or under sequence parallelism through
    the sequence all-gather whose backward reduce-scatter sums every rank's partial
    gradient (``layers.linear.sequence_parallel_linear``: only this rank's shard is kept for
    backward, under autocast in its dtype). The weight is the word embedding's shard (tied)
    or its own.
    """

    def __init__(self, cfg: ModelConfig, *, tied: bool, bias: bool, tp_group, dtype, device):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, cfg.sequence_parallel
        self.vocab_size = cfg.vocab_size
        tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
        padded = cfg.padded_vocab_size(tp_size)
        factory = {"dtype": dtype or torch.get_default_dtype(), "device": device}
        self.weight = self.bias = None
        if not tied:
            full = build_master_weight(
                (padded, cfg.hidden_size),
                unpadded_normal_init(cfg.vocab_size, cfg.init_std),
                factory["dtype"],
            )
            self.weight = nn.Parameter(shard(full, 0, tp_rank, tp_size).to(**factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(padded // tp_size, **factory))
        for p in (self.weight, self.bias):
            if p is not None:
                mark_tp_dim(p, 0)
                mark_vocab_padded(p)

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if self.weight is not None else tied_weight
        if self.sequence_parallel:  # as every sequence-parallel column linear: the shard kept
            return sequence_parallel_linear(
                x, weight, self.bias, self.tp_group, 0, comm_timer_of(self)
            )
        return linear_after_copy(x, weight, self.bias, self.tp_group, comm_timer_of(self))


class ParallelModel(nn.Module):
    """Base of the models: layout-independent full weights in and out.

    Names are the module paths, identical at every TP size; tensors have full shape
    (vocabulary unpadded). Every TP rank must call these together (they all-gather).
    """

    ARCH: str  # the model.arch (engine/models/families.py) a concrete class builds
    cfg: ModelConfig
    tp_group: dist.ProcessGroup | None

    # What a pipeline cut (engine/pipeline/stages.py) asks the model. The cut keeps the
    # embedding on the first stage, a run of layers on each, the modules named here on the
    # last, and runs the hooks below on each stage (the class's functions with the stage as
    # ``self``). So a hook reads only what a stage shares with the whole model: ``cfg``,
    # ``tp_group``, ``kernels``, ``embedding`` (on the last stage only ``embedding.word``, and
    # only when the embeddings are tied), the modules in ``pipeline_heads``, the model's own
    # buffers and its properties (``rotary``); it calls module-level functions, not the model's
    # other methods. Empty ``pipeline_heads``: the model cannot be cut.
    pipeline_heads: tuple[str, ...] = ()  # the last stage's modules, in registration order

    @property
    def rotary(self) -> bool:
        """Rotary positions: the attention rotates queries and keys (no position table)."""
        return self.cfg.position_embedding == "rotary"

    def embed(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The first stage's hidden ``[s(/tp), b, h]`` of its positional inputs (those
        :meth:`stage_inputs` gives, ids ``[b, s]`` first)."""
        raise NotImplementedError

    def rotary_for(
        self, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary (cos, sin) for ``positions`` ``[b, s]`` (a cp rank's global ones; None:
        0 … s−1 of a stage's ``hidden``, a sequence shard under SP), passed to every layer;
        None: the layers take no rotary tables."""
        return None

    def head(self, hidden: torch.Tensor):
        """The last stage's outputs of the final hidden ``[s(/tp), b, h]`` (a tensor or a
        tuple of tensors), as :meth:`stage_loss` takes them."""
        raise NotImplementedError

    def stage_inputs(self, micro_batches: list, device: torch.device) -> tuple:
        """The micro-batches (as the model's dataset yields them) moved to ``device`` and
        stacked in order into a pipeline schedule's whole-batch inputs: (the first stage's
        positional inputs, every stage's keyword inputs, the target). The target is one
        tensor, split by the schedule along dim 0 like the inputs."""
        raise NotImplementedError

    def stage_loss(self, outputs, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch: the :meth:`head` outputs against its rows of the
        :meth:`stage_inputs` target (the same value :meth:`loss` gives the unsplit model)."""
        raise NotImplementedError

    def loss(self, batch) -> torch.Tensor:
        """The scalar training loss of one micro-batch in the form the model's dataset yields
        (so the trainer, the verifier and benchmarks never ask which model it is)."""
        raise NotImplementedError

    def context_shard(self, batch, cp_size: int, cp_rank: int):
        """Context parallelism: cp rank ``cp_rank``'s part of a micro-batch (as the dataset
        yields it, whole sequences), in the form :meth:`loss` takes, with each token's
        global position. Every rank of a cp group then holds the same number of tokens of
        each sequence, so its mean loss, averaged over the group, is the whole sequence's."""
        raise NotImplementedError(f"{type(self).__name__} does not run context-parallel")

    def logits(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's named output logits for ``batch`` (vocabulary blocks stay sharded)."""
        raise NotImplementedError

    @property
    def full_names(self) -> tuple[str, ...]:
        """Every parameter name of the whole model (a pipeline stage holds some of them)."""
        return tuple(name for name, _ in self.named_parameters())

    def stored_elsewhere(self) -> tuple[str, ...]:
        """Names of parameters this rank holds as a copy whose original another rank
        checkpoints (a pipeline's tied embedding on the last stage)."""
        return ()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full-shape parameter}, gathered across TP (and experts across ep)."""
        ep = self.expert_groups()
        return {name: self._full(p, p.detach(), ep) for name, p in self.named_parameters()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """{name: full-shape gradient} (zeros where a parameter has none), gathered across TP
        (and experts across ep)."""
        ep = self.expert_groups()
        return {
            name: self._full(p, p.grad if p.grad is not None else torch.zeros_like(p), ep)
            for name, p in self.named_parameters()
        }

    def expert_groups(self) -> dict[nn.Parameter, dist.ProcessGroup]:
        """{parameter of experts split over ep: the ``expert`` group splitting it}."""
        return {
            p: module.ep_group
            for module in self.modules()
            if getattr(module, "ep_group", None) is not None
            for p in module.parameters()
            if expert_split(p) > 1
        }

    def _full(self, param: nn.Parameter, tensor: torch.Tensor, ep: dict) -> torch.Tensor:
        full = gather_along(tp_local(tensor), tp_dim(param), self.tp_group)
        full = dedupe_gathered(full, replicas(param), group_size(self.tp_group))
        if param in ep:  # each ep rank's block of experts, in ep rank order
            full = gather_along(full, 0, ep[param])
        return full[: self.cfg.vocab_size] if is_vocab_padded(param) else full

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slices out of a full state dict (as :meth:`full_state_dict` gives;
        it may also hold sigmoid routers' ``<router>.expert_bias``, as a training
        checkpoint's weights do: ``engine.checkpoint.convert.read_model_state``)."""
        routers = sigmoid_routers(self)
        biases = {n: state[n + BIAS_KEY].tolist() for n in routers if n + BIAS_KEY in state}
        held = {n + BIAS_KEY for n in biases}
        state = {k: v for k, v in state.items() if k not in held}
        load_router_biases(self, biases)
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        size, rank = group_size(self.tp_group), group_rank(self.tp_group)
        for name, param in own.items():
            full = state[name]
            if expert_split(param) > 1:  # this ep rank's block of experts
                full = shard(full, 0, expert_rank(param), expert_split(param))
            dim = tp_dim(param)
            if is_vocab_padded(param):
                if full.shape[0] != self.cfg.vocab_size:
                    raise ValueError(
                        f"{name}: {full.shape[0]} vocabulary rows, config says {self.cfg.vocab_size}"
                    )
                rows = param.shape[0] * (size if dim == 0 else 1)
                full = F.pad(full, (0, 0) * (full.dim() - 1) + (0, rows - full.shape[0]))
            copies = replicas(param)
            if copies > 1:  # a block held whole by `copies` ranks (GQA past the KV heads)
                local = owned_block(full, copies, rank, size)
            else:
                local = shard(full, dim, rank, size)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: full shape {tuple(state[name].shape)} does not fit the model's "
                    f"{tuple(param.shape)} shard at tp_size={size}"
                )
            assign_tp_local_(param, local)


class TransformerModel(ParallelModel):
    """A family's model: the shared trunk (embeddings and layers) and its own heads."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        rng: RNGTracker | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Build the trunk, then the heads the class adds in :meth:`_build_heads`, in that
        order (it fixes the master weights' RNG draws), then compile if ``cfg`` asks.

        ``tp_group`` and ``cp_group`` are the tensor- and context-parallel groups (None:
        the current state's TP group, no context parallelism); ``rng`` the TP-aware tracker
        that dropout draws from (None: the current state's).
        """
        super().__init__()
        build = self._build_trunk(
            cfg, tp_group=tp_group, cp_group=cp_group, rng=rng, dtype=dtype, device=device
        )
        self._build_heads(cfg, **build)
        self._compile_if_asked()

    def _build_heads(self, cfg: ModelConfig, *, tp_group, dtype, device) -> None:
        """Build the modules after the layers (``tp_group`` is the resolved one)."""
        raise NotImplementedError

    def _build_trunk(
        self, cfg: ModelConfig, *, tp_group, rng, dtype, device, cp_group=None
    ) -> dict:
        """Validate ``cfg`` and build the embeddings and the layers, in that order.

        The order fixes the RNG draws of the master weights, so it must not change.
        ``cp_group`` (context parallelism) goes to every layer's attention. Returns the
        keyword arguments the subclass builds its heads with.
        """
        if cfg.arch != self.ARCH:
            raise ValueError(
                f"{type(self).__name__} needs model.arch={self.ARCH!r}, got {cfg.arch!r}"
            )
        self.tp_group = resolve_tp_group(tp_group)
        cfg.validate(group_size(self.tp_group))
        self.cfg = cfg
        rng = rng if rng is not None else default_rng()
        self.kernels = resolve_kernels(cfg.kernels)  # once per model, handed to every layer
        build = dict(tp_group=self.tp_group, dtype=dtype, device=device)
        one = dict(rng=rng, kernels=self.kernels)
        self.embedding = Embeddings(cfg, **one, **build)
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(
                cfg, spec=spec_for(cfg, layer=i), cp_group=cp_group, **one, **build
            )
            for i in range(cfg.num_layers)
        )
        return build

    def _compile_if_asked(self) -> None:
        """``model.compile=true``: compile the whole forward and loss (``layers.compile``).
        Called last, once every module exists."""
        if self.cfg.compile:
            compile_model(
                self,
                backend=self.cfg.compile_backend,
                kernels=self.cfg.kernels,
                cuda_graphs=self.cfg.cuda_graphs,
            )
