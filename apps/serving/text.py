"""Text in and out of the serving engine: the tokenizer, its chat template, stop strings.

The engine speaks token ids; the HTTP front speaks text. ``TextCodec`` is the model's
``tokenizer.json`` with what a Hugging Face ``tokenizer_config.json`` beside it adds: the
end-of-sequence token (a completion ends there) and the chat template, a Jinja template
rendered in a sandbox as ``transformers``' ``apply_chat_template`` renders it.
``Detokenizer`` turns one choice's tokens into text as they come, holding back what a
stop string or an unfinished UTF-8 character could still change, so the streamed pieces
always add up to the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from engine.checkpoint.tokenizer import load_tokenizer
from engine.data.fsutil import read_json_object
from engine.models.families import family

REPLACEMENT = "\ufffd"  # what decoding shows for the bytes of an unfinished character


class TextCodec:
    """Encode, decode, and render chats for one model's tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None = None,
        special: dict[str, str] | None = None,
        template_name: str = "the chat template",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_name = template_name  # where the template came from, for errors
        self.special = special or {}  # "bos_token", "eos_token" → their text
        eos = self.special.get("eos_token")
        eos_id = None if eos is None else tokenizer.token_to_id(eos)
        self.eos_ids = frozenset() if eos_id is None else frozenset({eos_id})
        # Compiled now: a template that does not parse is refused at start, not per request.
        self._template = (
            None if chat_template is None else compile_template(chat_template, template_name)
        )

    @classmethod
    def from_files(
        cls, tokenizer_path: str, chat_template_path: str | None = None, *, arch: str | None = None
    ) -> TextCodec:
        """The tokenizer at ``tokenizer_path``, with what the Hugging Face files beside it
        say: ``tokenizer_config.json`` (the bos and eos tokens, a chat template) and
        ``chat_template.jinja`` (where transformers now saves the template; it wins over
        the config's, as in transformers). ``chat_template_path`` (a Jinja file) overrides
        both. A role no file names (a meshtron checkpoint's tokenizer has no config) is
        the first token of ``arch``'s family for it that the vocabulary holds
        (``Family.special_tokens``: a model trained here ends documents with its document
        end token), as the Hugging Face export names them."""
        tokenizer = load_tokenizer(tokenizer_path)  # a damaged file: ValueError naming it
        config_path = Path(tokenizer_path).parent / "tokenizer_config.json"
        jinja_path = Path(tokenizer_path).parent / "chat_template.jinja"
        config = read_json_object(config_path) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        name = f"{config_path}'s chat_template (--chat-template FILE overrides it)"
        if chat_template_path is not None:
            template = Path(chat_template_path).read_text()
            name = f"--chat-template {chat_template_path}"
        elif jinja_path.is_file():
            template = jinja_path.read_text()
            name = f"{jinja_path} (--chat-template FILE overrides it)"
        elif template is not None and not isinstance(template, str):
            raise ValueError(
                f"{config_path}: chat_template is a {type(template).__name__}, expected a string"
            )
        special = {}
        for role in ("bos_token", "eos_token"):
            value = config.get(role)
            if isinstance(value, dict):  # an AddedToken written out: {"content": ...}
                value = value.get("content")
            if isinstance(value, str):
                special[role] = value
        if arch is not None and not config_path.is_file():
            vocab = tokenizer.get_vocab()
            for role, tokens in family(arch).special_tokens.items():
                held = [token for token in tokens if token in vocab]
                if role in ("bos_token", "eos_token") and held:
                    special[role] = held[0]
        return cls(tokenizer, chat_template=template, special=special, template_name=name)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own added tokens, as
        ``tools/generate.py`` encodes prompts, unless ``special_tokens`` is False)."""
        # encode_batch, not encode: it lets go of the GIL while it works, so a long prompt
        # tokenized on a worker thread does not hold up the server's event loop too.
        return self.tokenizer.encode_batch([text], add_special_tokens=special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens dropped)."""
        return self.tokenizer.decode(list(ids))

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt the chat template makes of ``messages``, ending where the assistant's
        answer begins; ValueError when there is no template or it refuses the messages,
        :class:`TemplateFailed` when the template itself fails (a bug in it)."""
        if self._template is None:
            raise ValueError(
                "this model's tokenizer has no chat template (no chat_template in its "
                "tokenizer_config.json): use /v1/completions, or start the server with "
                "--chat-template FILE"
            )
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, **self.special
            )
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {_one_line(err)}") from None
        except Exception as err:
            raise TemplateFailed(
                f"{self.template_name} failed: {type(err).__name__}: {_one_line(err)}"
            ) from err


class TemplateFailed(RuntimeError):
    """The chat template raised while rendering (not a refusal of the messages): the
    server's template is at fault, not the request."""


def compile_template(text: str, name: str):
    """The Jinja chat template ``text``, compiled as ``transformers`` compiles it (a
    sandbox, ``raise_exception``); ValueError in one line naming ``name`` when it does not
    parse."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{name}: line {err.lineno}: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(getattr(err, "message", None) or err).split())


class Detokenizer:
    """One choice's text as its tokens arrive, cut at the first stop string.

    Each token decodes only a window: the last ``LOOKBACK`` tokens of the text already
    settled, and what came after them. The window's text less the text of its settled
    part is the new text (the lookback gives a decoder the context that a token's text can
    depend on: a word-start marker, a byte pair across tokens). Text is settled when it
    ends in no unfinished character. Should a window's text not begin with its settled
    part's, the whole sequence is decoded instead. Stop strings are searched for only
    where a new one can end. So a token costs O(1), not O(length) as decoding all of it."""

    LOOKBACK = 4  # settled tokens decoded again with each new one, for context

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.codec, self.stops = codec, [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""  # the text so far (after a stop string: up to it)
        self.sent = ""  # the part handed out by add() and finish()
        self.stopped = False  # a stop string appeared: no more tokens count
        self._settled = ""  # the text of ids[: self._read], final
        self._read = 0  # tokens whose text is settled
        self._start = 0  # where the decoded window begins (<= self._read)
        self._base = ""  # the text of ids[self._start : self._read] decoded alone
        self._searched = 0  # text before this has been searched for stop strings

    def add(self, token: int) -> str:
        """Take one token; return the new text that is safe to hand out now."""
        self.ids.append(token)
        text = self._decode()
        longest = max((len(s) for s in self.stops), default=1)
        start = max(0, min(self._searched, len(text)) - longest + 1)
        cuts = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
            return self.finish()
        self.text = text
        self._searched = len(text.rstrip(REPLACEMENT))
        return self._take(text[: len(text) - self._held_back(text)])

    def _decode(self) -> str:
        """The text of all the tokens, decoding only the window (class docstring)."""
        window = self.codec.decode(self.ids[self._start :])
        if window.startswith(self._base):
            text = self._settled + window[len(self._base) :]
        else:  # the context changed the settled part's text: decode it all
            text, self._searched = self.codec.decode(self.ids), 0
        if not text.endswith(REPLACEMENT):
            self._settled, self._read = text, len(self.ids)
            self._start = max(0, self._read - self.LOOKBACK)
            self._base = self.codec.decode(self.ids[self._start : self._read])
        return text

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change: an unfinished UTF-8
        character, or the start of a stop string."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def _take(self, safe: str) -> str:
        if not safe.startswith(self.sent):  # decoding changed earlier text: wait for the end
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self) -> str:
        """The text still held back, once the choice has ended."""
        return self._take(self.text)

    def kept_tokens(self) -> int:
        """How many of the tokens make up the text: all, or after a stop string, the
        fewest whose text reaches the cut."""
        if not self.stopped:
            return len(self.ids)
        return next(
            k
            for k in range(len(self.ids) + 1)
            if len(self.codec.decode(self.ids[:k])) >= len(self.text)
        )
