"""What the server answers: each choice's text and log-probabilities, in OpenAI's shapes.

A :class:`Choice` follows one engine request (one prompt, one of ``n``): its tokens, its
text through a :class:`Detokenizer` (cut at a stop string), and which tokens have been
handed out with text. ``CompletionShape`` and ``ChatShape`` write the whole response, or
the stream's chunks, of ``/v1/completions`` and ``/v1/chat/completions``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from apps.serving.requests import STOP, Scored, TokenEvent
from apps.serving.text import Detokenizer, TextCodec


class Choice:
    """One choice as its events arrive."""

    def __init__(self, index: int, prompt: list[int], codec: TextCodec, stops: list[str]):
        self.index, self.prompt, self.codec = index, prompt, codec
        self.request_id: str | None = None  # the engine's, once submitted
        self.detokenizer = Detokenizer(codec, stops)
        self.tokens: list[Scored] = []  # generated (past a stop string too)
        self.prompt_scores: tuple[Scored, ...] | None = None  # tokens 1.. of the prompt
        self.finish_reason: str | None = None  # "stop", "length" (or "cancelled")
        self.sent_tokens = 0  # tokens handed out with text so far
        self.sent_chars = 0  # characters of text handed out so far
        self.started = False  # a stream has sent this choice's first chunk

    def take(self, event: TokenEvent) -> tuple[str, list[Scored]]:
        """Take one event: the text and the tokens that can be handed out now."""
        if event.prompt is not None:
            self.prompt_scores = event.prompt
        text = ""
        if event.token is not None:
            self.tokens.append(Scored(event.token, event.logprob, event.top))
            text = self.detokenizer.add(event.token)
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            text += self.detokenizer.finish()
            self.finish_reason = "stop" if event.finish_reason == STOP else event.finish_reason
        tokens = []
        if text or self.finish_reason is not None:
            kept = self.detokenizer.kept_tokens()
            tokens, self.sent_tokens = self.tokens[self.sent_tokens : kept], kept
        self.sent_chars += len(text)
        return text, tokens

    @property
    def text(self) -> str:
        """The whole generated text (after a stop string: up to it)."""
        return self.detokenizer.text

    @property
    def kept(self) -> list[Scored]:
        """The generated tokens that make up the text."""
        return self.tokens[: self.detokenizer.kept_tokens()]


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    prompt = sum(map(len, prompts))
    completion = sum(len(c.kept) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def model_list(name: str, max_positions: int) -> dict:
    """``GET /v1/models``."""
    model = {"id": name, "object": "model", "created": 0, "owned_by": "meshtron"}
    return {"object": "list", "data": [model | {"max_model_len": max_positions}]}


class _Shape:
    object = ""
    prefix = ""

    def __init__(self, body, model: str, prompts: list[list[int]]) -> None:
        self.body, self.model, self.prompts = body, model, prompts
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def _envelope(self, choices: list[dict], object_: str) -> dict:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, choices: list[Choice], object_: str) -> dict:
        """The stream's last chunk when ``stream_options.include_usage`` asks for it."""
        return self._envelope([], object_) | {"usage": _usage(self.prompts, choices)}


class CompletionShape(_Shape):
    """``/v1/completions``: ``text_completion`` objects, with OpenAI's legacy logprobs."""

    prefix = "cmpl"

    def _logprobs(self, choice: Choice, tokens: list[Scored], echo: bool, offset: int):
        if self.body.logprobs is None:
            return None
        entries = [(s.token, s.logprob, s.top) for s in tokens]
        if echo:
            scores = [(s.token, s.logprob, s.top) for s in choice.prompt_scores or ()]
            entries = [(choice.prompt[0], None, None), *scores, *entries]
        decode = choice.codec.decode
        texts = [decode([token]) for token, _, _ in entries]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [
                None if top is None else {decode([t]): v for t, v in top} for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def response(self, choices: list[Choice]) -> dict:
        """The whole answer."""
        out = []
        for c in choices:
            echo = c.codec.decode(c.prompt) if self.body.echo else ""
            out.append(
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "logprobs": self._logprobs(c, c.kept, self.body.echo, 0),
                    "finish_reason": c.finish_reason,
                }
            )
        answer = self._envelope(out, "text_completion")
        return answer | {"usage": _usage(self.prompts, choices)}

    async def chunks(self, choices: list[Choice], events: AsyncIterator) -> AsyncIterator[dict]:
        """The stream: a chunk for each piece of text (the echoed prompt with the first)."""
        async for c, text, tokens in events:
            # text_offset counts from the start of the echoed prompt, if any
            base = len(c.codec.decode(c.prompt)) if self.body.echo else 0
            offset = base + c.sent_chars - len(text)
            echo = self.body.echo and not c.started
            if echo:
                text, offset = c.codec.decode(c.prompt) + text, 0
            c.started = True
            if not (text or tokens or c.finish_reason):
                continue
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": self._logprobs(c, tokens, echo, offset),
                "finish_reason": c.finish_reason,
            }
            yield self._envelope([choice], "text_completion")
        if self.body.include_usage:
            yield self.usage_chunk(choices, "text_completion")


def _chat_logprob(codec: TextCodec, token: int, logprob: float) -> dict:
    text = codec.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class ChatShape(_Shape):
    """``/v1/chat/completions``: ``chat.completion`` objects and their chunks."""

    prefix = "chatcmpl"

    def __init__(self, body, model: str, prompt: list[int]) -> None:
        super().__init__(body, model, [prompt])

    def _logprobs(self, codec: TextCodec, tokens: list[Scored]):
        if not self.body.logprobs:
            return None
        content = []
        for s in tokens:
            top = [_chat_logprob(codec, t, v) for t, v in s.top]
            content.append(_chat_logprob(codec, s.token, s.logprob) | {"top_logprobs": top})
        return {"content": content}

    def response(self, choices: list[Choice]) -> dict:
        """The whole answer."""
        out = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.codec, c.kept),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return self._envelope(out, "chat.completion") | {"usage": _usage(self.prompts, choices)}

    async def chunks(self, choices: list[Choice], events: AsyncIterator) -> AsyncIterator[dict]:
        """The stream: the assistant's role first, then a delta for each piece of text."""
        for c in choices:
            delta = {"role": "assistant", "content": ""}
            first = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
            yield self._envelope([first], "chat.completion.chunk")
        async for c, text, tokens in events:
            if not (text or tokens or c.finish_reason):
                continue
            choice = {
                "index": c.index,
                "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(c.codec, tokens),
                "finish_reason": c.finish_reason,
            }
            yield self._envelope([choice], "chat.completion.chunk")
        if self.body.include_usage:
            yield self.usage_chunk(choices, "chat.completion.chunk")
