"""What goes into the serving engine and what comes out: requests, refusals, token events."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.generate import Sampling

# Why a request ends (``TokenEvent.finish_reason``).
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass(frozen=True)
class Request:
    """One completion request, in token ids.

    ``sampling`` is the generation CLI's (greedy, temperature, top-k, top-p, seed); each
    request samples with its own generator seeded by ``sampling.seed``, so its tokens do not
    depend on what else is in the batch. Generation ends after ``max_tokens`` new tokens or
    at the first of ``stop_token_ids`` (which is kept as the last token).

    ``top_logprobs`` alternatives come with every token's log-probability; with
    ``prompt_logprobs`` the first event also scores every prompt token after the first
    (what ``echo`` with ``logprobs`` and log-likelihood evaluation need). With
    ``max_tokens`` 0 the prompt is then still run, to score it.
    """

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling(greedy=True)
    stop_token_ids: frozenset[int] = frozenset()
    request_id: str | None = None  # None: the engine names it
    top_logprobs: int = 0  # most likely alternatives reported with each token
    prompt_logprobs: bool = False


class Refused(Exception):
    """A request the engine will not take, and why (``code`` for the HTTP status later).

    Codes: ``bad_request`` (the request itself is wrong: 400), ``too_long`` (prompt plus
    max_tokens past the model's positions: 400), ``exceeds_cache`` (more KV blocks than the
    whole pool: 400), ``queue_full`` (try again later: 429).
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code, self.reason = code, reason


@dataclass(frozen=True)
class Scored:
    """A token, its log-probability and the ``top`` most likely ``(token, logprob)`` there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """What one step did to one request: a new token, its end, or both.

    ``token`` is None when the request ended without one (cancelled, or ``max_tokens`` 0).
    ``logprob`` is the chosen token's log-probability under the model's raw distribution
    (log-softmax of the logits, before temperature and the top-k/top-p filters); ``top``
    the request's ``top_logprobs`` alternatives. ``prompt`` scores the prompt's tokens
    after the first, on the request's first event, when it asked (``prompt_logprobs``).
    """

    request_id: str
    token: int | None
    logprob: float | None
    finish_reason: str | None = None  # STOP, LENGTH or CANCELLED on the request's last event
    top: tuple[tuple[int, float], ...] = ()
    prompt: tuple[Scored, ...] | None = None


@dataclass
class Completion:
    """A request's whole output, assembled from its events."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    prompt: tuple[Scored, ...] | None = None

    def add(self, event: TokenEvent) -> None:
        """Take one event of this request."""
        if event.prompt is not None:
            self.prompt = event.prompt
        if event.token is not None:
            self.tokens.append(event.token)
            self.logprobs.append(event.logprob)
            self.top.append(event.top)
        self.finish_reason = event.finish_reason or self.finish_reason
