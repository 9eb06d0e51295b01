"""The OpenAI request bodies the server takes, and their translation into engine requests.

Fields are the OpenAI API's (``/v1/completions``, ``/v1/chat/completions``) plus vLLM's
``top_k`` and ``ignore_eos``; an unknown field is refused (a typo would otherwise be
silently ignored), and so is a known one this server does not implement set to anything
but its neutral value (penalties, ``logit_bias``, ``suffix``, ``best_of``).
"""

from __future__ import annotations

import math
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict

from engine.generate import Sampling

MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI allows 5 on completions, 20 on chat)


class BadRequest(ValueError):
    """A request the server refuses with 400 and this one-line message."""


def _unicode(text: str, field: str) -> str:
    """``text``, unless it holds a lone surrogate (JSON lets ``"\\ud800"`` through, but it
    is no character: the tokenizer cannot take it): then a 400 naming ``field``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{field} contains a lone surrogate, not valid Unicode") from None
    return text


class _Body(BaseModel):
    # Strict, as OpenAI's API is: "5" is not a max_tokens, "yes" not a stream flag, and
    # true/false are not token ids (an int still stands for a float).
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = None  # None: 1; 0: greedy
    top_p: float | None = None
    top_k: int | None = None  # vLLM's: 0 or -1: no top-k filter
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None  # None: a fresh random seed for every request
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": bool}
    ignore_eos: bool = False  # vLLM's: keep going past the end-of-sequence token
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def check_unsupported(self) -> None:
        """Refuse a known field that would change the output in a way not implemented."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise BadRequest(f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported")
        if not 1 <= self.n <= 16:
            raise BadRequest(f"n must be in 1 .. 16, got {self.n}")
        if self.stream_options and set(self.stream_options) - {"include_usage"}:
            raise BadRequest("stream_options takes only include_usage")

    @property
    def stops(self) -> list[str]:
        """The stop strings, as a list."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise BadRequest(f"at most 16 stop strings, got {len(stops)}")
        return stops

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk that carries the usage."""
        return bool((self.stream_options or {}).get("include_usage"))

    def samplings(self, prompts: int = 1) -> list[Sampling]:
        """One Sampling per choice, ``n`` for each of ``prompts`` prompts in the choices'
        order: seeds ``seed``, ``seed + 1``, … (or fresh random ones), so no two choices
        share their draws, whichever prompt they continue."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            raise BadRequest(f"temperature must be >= 0 and finite, got {temperature}")
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        if top_k < 0:
            raise BadRequest(f"top_k must be >= 0 (or -1: off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise BadRequest(f"seed must be in 0 .. 2**64 - 1, got {self.seed}")
        samplings = []
        for i in range(prompts * self.n):
            seed = secrets.randbits(64) if self.seed is None else (self.seed + i) % 2**64
            sampling = Sampling(
                greedy=temperature == 0,
                temperature=temperature or 1.0,
                top_k=top_k,
                top_p=1.0 if self.top_p is None else self.top_p,
                seed=seed,
            )
            try:
                sampling.check()
            except ValueError as err:
                raise BadRequest(str(err)) from None
            samplings.append(sampling)
        return samplings


class CompletionBody(_Body):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # None: up to the model's context
    echo: bool = False
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        """Also: suffix and best_of."""
        super().check_unsupported()
        if self.suffix:
            raise BadRequest("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of is not supported (only equal to n)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be in 0 .. {MAX_TOP_LOGPROBS}, got {self.logprobs}")

    def prompts(self, encode) -> list[list[int]]:
        """The prompts as token ids (``encode``: text → ids); a list is a batch."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise BadRequest("prompt is empty")
        batch = prompt is self.prompt  # a list of prompts, not one wrapped as a list
        ids = [
            encode(_unicode(p, f"prompt[{i}]" if batch else "prompt"))
            if isinstance(p, str)
            else list(p)
            for i, p in enumerate(prompt)
        ]
        if any(not p for p in ids):
            raise BadRequest("a prompt encodes to no tokens")
        return ids


class ChatMessage(BaseModel):
    """One message of a chat; content as text or OpenAI's list of text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None

    def as_template_input(self, field: str = "content") -> dict:
        """What a chat template reads: ``{"role", "content"}`` with the text joined
        (``field``: the content's name in errors)."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise BadRequest("only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        return {"role": self.role, "content": _unicode(content or "", field)}


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the model's context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        """Also: the messages and top_logprobs."""
        super().check_unsupported()
        if not self.messages:
            raise BadRequest("messages is empty")
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS or (top and not self.logprobs):
            raise BadRequest(f"top_logprobs must be in 0 .. {MAX_TOP_LOGPROBS}, with logprobs")

    def template_input(self) -> list[dict]:
        """The messages as the chat template reads them."""
        return [m.as_template_input(f"messages[{i}].content") for i, m in enumerate(self.messages)]

    @property
    def limit(self) -> int | None:
        """The new-token limit asked for (None: up to the context)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
