"""Continuous batching over the paged KV cache: requests join and leave at any step.

Each :meth:`ServingEngine.step` admits waiting requests while there is room (a running
slot and a KV reservation for the request's longest length), then spends at most
``token_budget`` tokens: one for every sequence that is decoding, the rest on prompt
chunks of sequences still in prefill (a long prompt is split over several steps). The
decoding rows run as one forward, the prefill chunks as another; each row samples its
next token with its own seeded generator once its whole context is in the cache.

The forward is meshtron's own model (``engine.models``), unchanged: the cache it is handed
is one object per layer, which stores the step's new keys and values in the sequences'
blocks and gives back each row's whole past as a left-padded ``[b, heads, past + s, d]``
(the padding masked). A prefill forward gathers it out of the blocks (:class:`_PagedLayer`);
the decode forward reads it in place from the decoding rows' lanes (``apps.serving.lanes``:
a contiguous copy appended to each step, so a step copies no past). So a row sees exactly
its own tokens whatever else is in the batch; only the floating-point summation order over
the padded width and batch can change (see tests/test_serving.py for the tolerance).

At tp > 1 the model is one rank's shard and the cache holds that rank's KV heads. The
scheduling rank (TP rank 0) decides every forward alone and sends it as a
:class:`StepPlan` (ids, positions, the cache slots to write and read); every other rank
runs :func:`follow`, the same :func:`run_plan` on its shard and its own cache, so the
collectives inside the forward (and the logits' gather) line up. Sampling is rank 0's.

Two costs remain: a prefill chunk still gathers its row's past out of the blocks (a
paged-attention kernel would read them in place), and a prefill forward pads every chunk
to the longest one (the budget counts real tokens only).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from apps.serving.lanes import LaneOps, LanePlanner
from apps.serving.paged_cache import BlockTable, PagedKVCache, PoolFull
from apps.serving.requests import (
    CANCELLED,
    LENGTH,
    STOP,
    Completion,
    Refused,
    Request,
    Scored,
    TokenEvent,
)
from engine.generate import next_tokens
from layers.mappings import gather_from_tp
from parallel_state.groups import group_size


@dataclass
class _Sequence:
    """A request in the engine: its tokens so far and where its cache stands."""

    request: Request
    request_id: str
    generator: torch.Generator
    tokens: list[int]  # prompt + generated
    table: BlockTable | None = None  # set on admission
    cached: int = 0  # leading positions whose keys and values are in the cache
    generated: list[int] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)  # prompt tokens 1.., when asked

    @property
    def pending(self) -> int:
        """Tokens to feed before the next one can be sampled (or, scoring a prompt with
        max_tokens 0, before it is done: its last token predicts nothing asked for)."""
        return len(self.tokens) - self.cached - (self.request.max_tokens == 0)


class _PagedLayer:
    """What a layer's attention takes as its KV cache (``layers.attention.KVCache``'s
    ``length`` and ``append``), over the pool: one step, one layer."""

    def __init__(self, cache: PagedKVCache, layer: int, write, read, past: int) -> None:
        self.cache, self.layer, self.write, self.read = cache, layer, write, read
        self.length = past  # the left-padded past every row's keys are aligned to

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's ``[b, heads, s, d]``; return each row's whole context."""
        return self.cache.write_and_read(self.layer, self.write, self.read, k, v)


@dataclass(frozen=True)
class StepPlan:
    """One batched forward, all a TP rank needs to run it on its shard: the ids and
    positions ``[b, s]``, the cache slots to write ``[b, s]`` and to read ``[b, past + s]``
    (the scratch slot where padded), and the ``(row, first column, count)`` of the rows
    whose prompt tokens are scored. Block tables and sampling stay on the scheduling rank:
    the slots are all the others need of them. A decode forward reads the lanes instead:
    ``read`` is None, ``lanes`` the lane operations and ``mask`` ``[b, past + 1]`` (False
    at padding)."""

    ids: torch.Tensor
    positions: torch.Tensor
    write: torch.Tensor
    read: torch.Tensor | None
    past: int
    scores: tuple[tuple[int, int, int], ...] = ()
    lanes: LaneOps | None = None
    mask: torch.Tensor | None = None


@torch.inference_mode()
def run_plan(model, cache: PagedKVCache, plan: StepPlan):
    """Run ``plan`` on this rank's shard of ``model`` and of the KV ``cache``: the scored
    rows' ``[count, V]`` log-probabilities and the last position's ``[b, V]`` logits
    (float32, CPU, gathered over TP: every rank runs the same collectives, in order)."""
    device = next(model.parameters()).device
    write = plan.write.to(device)
    if plan.lanes is not None:
        mask = plan.mask
        cache.lanes.apply(plan.lanes)
        width, column = plan.past + 1, plan.lanes.column
        layers = [cache.lanes.layer(i, write, column, width) for i in range(len(model.layers))]
    else:
        mask, read = plan.read != cache.scratch_slot, plan.read.to(device)
        layers = [_PagedLayer(cache, i, write, read, plan.past) for i in range(len(model.layers))]
    logits = model(
        plan.ids.to(device),
        attention_mask=mask.to(device),
        positions=plan.positions.to(device),
        cache=layers,
    )
    scored = [
        torch.log_softmax(_full_logits(model, logits[i, first : first + count]), dim=-1)
        for i, first, count in plan.scores
    ]
    return scored, _full_logits(model, logits[:, -1])


def _full_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """``[n, V / tp]`` logits → ``[n, V]`` float32 CPU logits, vocabulary padding cut."""
    full = gather_from_tp(logits, model.tp_group)
    return full[:, : model.cfg.vocab_size].float().cpu()


def follow(model, cache: PagedKVCache, channel) -> int:
    """A TP rank other than the scheduling one: run every plan ``channel`` receives on this
    rank's shard until it receives ``None`` (the server stopped). Returns the forwards run."""
    model.eval()
    count = 0
    while (plan := channel.receive()) is not None:
        run_plan(model, cache, plan)
        count += 1
    return count


class ServingEngine:
    """Runs requests on ``model`` (built with ``engine.inference.inference_config``) over
    ``cache``: :meth:`submit`, :meth:`cancel`, and :meth:`step` until idle. At tp > 1 this
    is the scheduling rank's engine: ``channel`` sends each forward's :class:`StepPlan` to
    the other ranks, which run :func:`follow` over their own shard and cache."""

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        *,
        max_running: int = 16,
        max_waiting: int = 64,
        token_budget: int = 256,
        channel=None,
        decode_lanes: bool = True,
    ) -> None:
        if not model.cfg.causal or model.cfg.sequence_parallel:
            raise ValueError("serving needs a decoder built without sequence parallelism")
        if group_size(model.tp_group) > 1 and channel is None:
            raise ValueError(
                "at tp > 1 the engine needs a channel to send each step's plan to the other "
                "ranks (apps.serving.tp.PlanChannel), which run follow()"
            )
        if not 1 <= max_running <= token_budget:
            raise ValueError(
                f"need 1 <= max_running ({max_running}) <= token_budget ({token_budget}): "
                "every decoding sequence takes one token of a step"
            )
        self.model, self.cache = model.eval(), cache
        self.max_running = max_running  # sequences in the batch at once
        self.max_waiting = max_waiting  # queued past that: refused, not grown without bound
        self.token_budget = token_budget  # tokens fed per step, decoding and prefill together
        self.channel = channel  # sends each forward's plan to the other TP ranks (tp > 1)
        # Decode forwards read the lanes (apps.serving.lanes); False: gather like prefill.
        self._lanes = LanePlanner(max_running) if decode_lanes else None
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # in admission order
        self._events: list[TokenEvent] = []  # ends decided between steps (cancel, max_tokens 0)
        self._names = (f"req-{i}" for i in itertools.count())

    # --- requests in and out ------------------------------------------------------------

    def submit(self, request: Request) -> str:
        """Queue ``request``; returns its id. Raises :class:`Refused` with the reason when it
        is malformed, can never fit, or the queue is full (it never waits here)."""
        self._check(request)
        if len(self.waiting) >= self.max_waiting:
            raise Refused("queue_full", f"{len(self.waiting)} requests are already waiting")
        live = {s.request_id for s in itertools.chain(self.waiting, self.running)}
        if request.request_id in live:
            raise Refused("bad_request", f"request id {request.request_id!r} is already in use")
        rid = request.request_id or next(n for n in self._names if n not in live)
        generator = torch.Generator().manual_seed(request.sampling.seed)
        seq = _Sequence(request, rid, generator, list(request.prompt))
        if request.max_tokens == 0 and not (request.prompt_logprobs and seq.pending):
            scored = () if request.prompt_logprobs else None
            self._events.append(TokenEvent(rid, None, None, LENGTH, prompt=scored))
        else:
            self.waiting.append(seq)
        return rid

    def _check(self, request: Request) -> None:
        cfg = self.model.cfg
        try:
            request.sampling.check()
        except ValueError as err:
            raise Refused("bad_request", str(err)) from None
        if not request.prompt:
            raise Refused("bad_request", "the prompt needs at least one token")
        if not all(0 <= t < cfg.vocab_size for t in request.prompt):
            raise Refused("bad_request", f"prompt token ids must be in 0 .. {cfg.vocab_size - 1}")
        if request.max_tokens < 0:
            raise Refused("bad_request", f"max_tokens must be >= 0, got {request.max_tokens}")
        if not 0 <= request.top_logprobs <= cfg.vocab_size:
            raise Refused("bad_request", f"top_logprobs must be in 0 .. {cfg.vocab_size}")
        total = len(request.prompt) + request.max_tokens
        if total > cfg.max_positions:
            raise Refused(
                "too_long",
                f"{len(request.prompt)} prompt tokens + max_tokens {request.max_tokens} = "
                f"{total} positions; the model has {cfg.max_positions}",
            )
        need = self.cache.blocks_for(_cached_length(request))
        if need > self.cache.num_blocks:
            raise Refused(
                "exceeds_cache",
                f"{_cached_length(request)} cached positions need {need} KV blocks; the "
                f"whole cache has {self.cache.num_blocks}",
            )

    def cancel(self, request_id: str) -> bool:
        """End a waiting or running request now, freeing its blocks; its CANCELLED event
        comes with the next step. False when no such request is in the engine."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                break
        else:
            seq = next((s for s in self.running if s.request_id == request_id), None)
            if seq is None:
                return False
            self._retire(seq)
        self._events.append(TokenEvent(request_id, None, None, CANCELLED))
        return True

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self.waiting or self.running or self._events)

    # --- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Admit, run one batched step, and return what happened to each request."""
        events, self._events = self._events, []
        self._admit()
        decode, prefill = self._schedule()
        if decode and self._lanes is not None:
            decode, plan = self._lane_plan(decode)
            events += self._sample(decode, self._forward(decode, plan))
        elif decode:
            events += self._sample(decode, self._forward(decode, self._padded_plan(decode)))
        if prefill:
            events += self._sample(prefill, self._forward(prefill, self._padded_plan(prefill)))
        return events

    def _admit(self) -> None:
        """Move waiting requests to running, first come first served, while they fit."""
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            try:
                seq.table = self.cache.reserve(_cached_length(seq.request))
            except PoolFull:
                return  # it fits once running sequences free their blocks
            self.running.append(self.waiting.popleft())

    def _schedule(self) -> tuple[list, list]:
        """(decoding rows, prefill rows): ``(sequence, tokens to feed)`` within the budget."""
        decode = [(s, 1) for s in self.running if s.pending == 1]
        budget = self.token_budget - len(decode)
        prefill = []
        for seq in self.running:
            if seq.pending > 1 and budget > 0:
                prefill.append((seq, min(seq.pending, budget)))
                budget -= prefill[-1][1]
        return decode, prefill

    def _padded_plan(self, rows: list[tuple[_Sequence, int]]) -> StepPlan:
        """The plan that feeds each row's chunk, its past gathered from the blocks.

        Row i's context (cached past + chunk) is right-aligned in a ``past + s`` window, as
        left padding: the last column is every row's newest token."""
        past, s = max(seq.cached for seq, _ in rows), max(n for _, n in rows)
        scratch = self.cache.scratch_slot
        ids = torch.zeros(len(rows), s, dtype=torch.long)
        positions = torch.zeros_like(ids)
        write = torch.full_like(ids, scratch)
        read = torch.full((len(rows), past + s), scratch, dtype=torch.long)
        scores = []
        for i, (seq, n) in enumerate(rows):
            end = seq.cached + n
            self.cache.grow(seq.table, end)
            ids[i, s - n :] = torch.tensor(seq.tokens[seq.cached : end])
            positions[i, s - n :] = torch.arange(seq.cached, end)
            write[i, s - n :] = self.cache.slots(seq.table, seq.cached, end)
            read[i, past + s - end :] = self.cache.slots(seq.table, 0, end)
            # Prompt tokens this chunk's positions predict (position j predicts token j + 1).
            count = min(n, len(seq.request.prompt) - 1 - seq.cached)
            if seq.request.prompt_logprobs and count > 0:
                scores.append((i, s - n, count))
        return StepPlan(ids, positions, write, read, past, tuple(scores))

    def _lane_plan(self, rows: list[tuple[_Sequence, int]]) -> tuple[list, StepPlan]:
        """(the decoding rows in lane order, the plan feeding their one token each), the
        past read in place from the lanes: the same left-padded layout as the gather."""
        ops = self._lanes.plan([seq for seq, _ in rows], self.cache)
        rows = [(seq, 1) for seq in self._lanes.rows]
        cached = torch.tensor([seq.cached for seq, _ in rows])
        width = int(cached.max()) + 1
        mask = torch.arange(width)[None, :] >= width - 1 - cached[:, None]
        scores = []
        for i, (seq, _) in enumerate(rows):
            self.cache.grow(seq.table, seq.cached + 1)
            if seq.request.prompt_logprobs and len(seq.request.prompt) - 1 - seq.cached > 0:
                scores.append((i, 0, 1))
        ids = torch.tensor([[seq.tokens[seq.cached]] for seq, _ in rows])
        write = torch.stack([self.cache.slots(s.table, s.cached, s.cached + 1) for s, _ in rows])
        plan = StepPlan(ids, cached[:, None], write, None, width - 1, tuple(scores), ops, mask)
        return rows, plan

    def _forward(self, rows: list[tuple[_Sequence, int]], plan: StepPlan) -> torch.Tensor:
        """Last-position logits ``[b, V]`` (float32, CPU) after running ``plan`` on
        ``rows``: :func:`run_plan`, which the other TP ranks run on the same plan."""
        if self.channel is not None:
            self.channel.send(plan)
        scored, last = run_plan(self.model, self.cache, plan)
        for (i, _, count), logprobs in zip(plan.scores, scored, strict=True):
            seq = rows[i][0]
            targets = seq.request.prompt[seq.cached + 1 : seq.cached + 1 + count]
            for row, token in zip(logprobs, targets, strict=True):
                seq.scored.append(_scored(row, token, seq.request.top_logprobs))
        for seq, n in rows:
            seq.cached += n
            seq.table.length = seq.cached
        return last

    def _sample(self, rows, logits: torch.Tensor) -> list[TokenEvent]:
        """The next token of every row whose context is now all cached, and the ends."""
        events = []
        for i, (seq, _) in enumerate(rows):
            if seq.pending:  # a prompt chunk with more to come: nothing to sample yet
                continue
            request = seq.request
            prompt = tuple(seq.scored) if request.prompt_logprobs and not seq.generated else None
            if request.max_tokens == 0:  # the prompt is scored: done
                self._retire(seq)
                events.append(TokenEvent(seq.request_id, None, None, LENGTH, prompt=prompt))
                continue
            token = int(next_tokens(logits[i : i + 1], request.sampling, seq.generator))
            scored = _scored(torch.log_softmax(logits[i], dim=-1), token, request.top_logprobs)
            seq.tokens.append(token)
            seq.generated.append(token)
            reason = None
            if token in request.stop_token_ids:
                reason = STOP
            elif len(seq.generated) == request.max_tokens:
                reason = LENGTH
            if reason is not None:
                self._retire(seq)
            events.append(
                TokenEvent(
                    seq.request_id, token, scored.logprob, reason, top=scored.top, prompt=prompt
                )
            )
        return events

    def _retire(self, seq: _Sequence) -> None:
        """Take ``seq`` out of the running batch and give its blocks back."""
        self.running.remove(seq)
        self.cache.release(seq.table)

    def run_until_idle(self) -> dict[str, Completion]:
        """Step until nothing is left; returns ``{request id: Completion}`` of what ended."""
        done: dict[str, Completion] = {}
        while self.has_work:
            for event in self.step():
                done.setdefault(event.request_id, Completion(event.request_id)).add(event)
        return done


def _scored(logprobs: torch.Tensor, token: int, top: int) -> Scored:
    """``token``'s entry of one position's ``[V]`` log-probabilities, with the ``top``
    most likely."""
    alternatives = ()
    if top:
        values, ids = logprobs.topk(top)
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return Scored(token, float(logprobs[token]), alternatives)


def _cached_length(request: Request) -> int:
    """Positions a request can put in the cache: the last new token is never fed back."""
    return len(request.prompt) + request.max_tokens - 1
