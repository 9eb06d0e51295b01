"""apps.serve: requests and options the server must refuse in its error shape, and go on.

The same tiny exported GPT and in-process server as tests/test_serve.py (its helpers). Each
refusal is OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``, with a
one-line message: a body over ``--max-body-mb`` (413, with or without a Content-Length), a
lone surrogate in a prompt or a chat message (400), a chat template that does not parse
(refused at start) or fails while rendering (500), more sequences in one request than
``--max-waiting`` lets wait (400, not a 429 no retry could end), and an unknown route, a
wrong method or an unreadable body (404, 405, 400). Prompts are tokenized on a worker
thread, never on the event loop's.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from tests.test_serve import TIMEOUT, _serving, make_export
from tests.threads_util import torch_threads

HEADERS = {"content-type": "application/json"}
BAD_TEMPLATE = "{% for m in messages %}<{{ m.role }}>"  # no endfor
FAILING_TEMPLATE = "{{ messages | length // 0 }}"  # raises at render, not at parse


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: intra-op threads waiting for a shared core only slow them."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(export directory, tokenizer, the model before export); chat.jinja beside it."""
    return make_export(tmp_path_factory.mktemp("serve_bad") / "tiny")


@pytest.fixture(scope="module")
def served(export):
    """A server with a chat template, 4 running, 8 waiting: (openai client, routes' state)."""
    template = str(export[0].parent / "chat.jinja")
    options = ("--chat-template", template, "--max-running", "4", "--max-waiting", "8")
    with _serving(export[0], *options) as pair:
        yield pair


def _urls(client) -> tuple[str, str]:
    """The API's base (``…/v1``) and the server's root."""
    base = str(client.base_url).rstrip("/")
    return base, base.removesuffix("/v1")


def _post(url: str, content, **kwargs) -> httpx.Response:
    if not isinstance(content, (str, bytes)) and not hasattr(content, "__next__"):
        content = json.dumps(content)
    return httpx.post(url, content=content, headers=HEADERS, timeout=TIMEOUT, **kwargs)


def _refused(answer: httpx.Response, status: int, code: str, *words: str) -> str:
    """Assert the server's error shape, ``status`` and ``code``; the message."""
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json", answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    kind = "invalid_request_error" if status < 500 else "server_error"
    assert error["type"] == kind and error["param"] is None and error["code"] == code, error
    message = error["message"]
    assert "\n" not in message and all(w in message for w in words), message
    return message


def _works(client) -> None:
    """A good request still gets its answer."""
    answer = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert answer.choices[0].finish_reason == "length"


def test_a_body_over_max_body_mb_gets_413_with_or_without_a_content_length(export):
    # 0.001 MiB: 1048 bytes
    with _serving(export[0], "--max-body-mb", "0.001") as (client, _):
        base, _ = _urls(client)
        # padded with "user" (the model has 128 positions): a body, not a prompt, too long
        pad = {"model": "tiny", "prompt": "x", "max_tokens": 1}
        over = json.dumps({**pad, "user": "u" * 1100}).encode()
        answer = _post(f"{base}/completions", over)
        _refused(answer, 413, "body_too_large", f"is {len(over)} bytes", "1048 bytes")
        # Chunked, no Content-Length: refused once it passes the limit.
        chunks = (over[i : i + 100] for i in range(0, len(over), 100))
        answer = _post(f"{base}/completions", chunks)
        _refused(answer, 413, "body_too_large", "passes the limit of 1048 bytes")
        # Just under the limit, either way: served as before.
        under = json.dumps({**pad, "user": "u" * 900}).encode()
        assert len(under) <= 1048
        for content in (under, (under[i : i + 100] for i in range(0, len(under), 100))):
            answer = _post(f"{base}/completions", content)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["finish_reason"] == "length"
        _works(client)


def test_max_body_mb_is_in_the_help_and_must_be_positive(capsys):
    from apps.serve import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--max-body-mb" in capsys.readouterr().out
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as stop:
            parse_args(["--weights", "w", "--max-body-mb", value])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1, err
        assert "--max-body-mb" in err and "must be a finite number > 0" in err, err


def test_max_waiting_0_is_refused_at_start(capsys):
    """No request could ever be queued (every one would get a 429): one line, exit 2."""
    from apps.serve import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(["--weights", "w", "--max-waiting", "0"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.endswith(
        "argument --max-waiting: 0 must be >= 1 (see --help)"
    )


def test_prompts_are_tokenized_off_the_event_loop(served, monkeypatch):
    """Tokenizing a long prompt takes seconds: on the event loop's thread it would hold up
    every other request (/health included). So encode must run where no loop runs."""
    client, state = served
    encode = state.codec.encode
    calls: list[bool] = []

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            calls.append(True)
        except RuntimeError:  # no event loop in this thread
            calls.append(False)
        return encode(*args, **kwargs)

    monkeypatch.setattr(state.codec, "encode", recording)
    client.completions.create(model="tiny", prompt="def add", max_tokens=1)
    client.completions.create(model="tiny", prompt=["def", "import"], max_tokens=1)
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert calls == [False] * 4


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("completions", '{"model": "tiny", "prompt": "a\\ud800"}', "prompt contains"),
        ("completions", '{"model": "tiny", "prompt": ["x", "a\\udfff b"]}', "prompt[1] contains"),
        (
            "chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "x"}, '
            '{"role": "user", "content": "\\ud800"}]}',
            "messages[1].content contains",
        ),
        (
            "chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", '
            '"content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages[0].content contains",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(served, route, body, field):
    client, _ = served
    base, _ = _urls(client)
    answer = _post(f"{base}/{route}", body)
    _refused(answer, 400, "invalid_request", field, "lone surrogate")
    _works(client)


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("completions", '{"model": "tiny", "prompt": "a", "max_tokens": "5"}', "max_tokens"),
        ("completions", '{"model": "tiny", "prompt": "a", "stream": "yes"}', "stream"),
        ("completions", '{"model": "tiny", "prompt": [true, false]}', "prompt"),
        ("completions", '{"model": "tiny", "prompt": "a", "logprobs": true}', "logprobs"),
        (
            "chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": "2"}',
            "n",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_400_not_coerced(served, route, body, field):
    """As OpenAI's API: a string is not a number, "yes" not a boolean, true/false not token
    ids (they were read as 1 and 0)."""
    client, _ = served
    base, _ = _urls(client)
    message = _refused(_post(f"{base}/{route}", body), 400, "invalid_request", field)
    assert message.startswith(field), message
    _works(client)


def test_a_chat_template_that_does_not_parse_is_refused_at_start(export, tmp_path, capsys):
    from apps.serve import main

    template = tmp_path / "broken.jinja"
    template.write_text(BAD_TEMPLATE)
    # A port in use: were the template let through, the start would fail on it instead
    # (never serve), so the test ends either way.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        argv = ["--weights", str(export[0]), "--chat-template", str(template), "--port", port]
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"serve: --chat-template {template}: line 1: "), err
    assert "Unexpected end of template" in err, err


def test_a_port_in_use_is_one_line_before_the_weights_load(export, capsys, monkeypatch):
    """A taken --port printed Python's "[Errno 98] Address already in use (while attempting
    to bind on address ...)" after the model had loaded (minutes, for a large one). Now the
    port is bound first, and the line names the flag; ``build`` (which loads the weights)
    is replaced by a failure to show it is never reached."""
    import apps.serve

    def loads(*args, **kwargs):
        raise AssertionError("the weights were loaded before the port was checked")

    monkeypatch.setattr(apps.serve, "build", loads)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert apps.serve.main(["--weights", str(export[0]), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"serve: --port {port} on 127.0.0.1 is in use: pass another --port (0: any free port)\n"
    )


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_outside_tcps_range_is_one_line(export, port, capsys, monkeypatch):
    """--port 70000 was socket's "OverflowError: bind(): port must be 0-65535." traceback;
    TCP ports are 16 bits (0 .. 65535), so it is refused by the parser, before loading."""
    import apps.serve

    def loads(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(apps.serve, "build", loads)
    with pytest.raises(SystemExit) as stop:
        apps.serve.main(["--weights", str(export[0]), "--port", port])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    expected = "must be in 0 .. 65535 (0: any free port)" if port == "70000" else "must be >= 0"
    assert err == f"serve: error: argument --port: {port} {expected} (see --help)\n", err


def test_a_chat_template_that_fails_while_rendering_gives_500_naming_it(export, tmp_path):
    template = tmp_path / "failing.jinja"
    template.write_text(FAILING_TEMPLATE)
    with _serving(export[0], "--chat-template", str(template)) as (client, _):
        base, _ = _urls(client)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        answer = _post(f"{base}/chat/completions", body)
        _refused(answer, 500, "chat_template_error", str(template), "ZeroDivisionError")
        _works(client)


def test_more_sequences_than_max_waiting_is_400_not_a_429(served):
    """--max-waiting 8: n × prompts over 8 could never wait at once, however idle."""
    client, _ = served
    base, _ = _urls(client)
    for body, words in [
        ({"prompt": "x", "n": 9}, "1 prompt(s) × n 9 = 9 sequences"),
        ({"prompt": ["x", "y", "z"], "n": 3}, "3 prompt(s) × n 3 = 9 sequences"),
    ]:
        answer = _post(f"{base}/completions", {"model": "tiny", "max_tokens": 1, **body})
        _refused(answer, 400, "too_many_sequences", *words, "--max-waiting 8", "at most 8")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 9}
    answer = _post(f"{base}/chat/completions", chat)
    _refused(answer, 400, "too_many_sequences", "= 9 sequences", "--max-waiting 8")
    # At the limit: served.
    answer = client.completions.create(model="tiny", prompt=["x", "y"], n=4, max_tokens=1)
    assert len(answer.choices) == 8


def test_unknown_routes_wrong_methods_and_unreadable_bodies_get_the_error_shape(served):
    client, _ = served
    base, root = _urls(client)
    answer = httpx.get(f"{root}/v2/completions", timeout=TIMEOUT)
    _refused(answer, 404, "not_found", "GET /v2/completions", "/v1/completions")
    answer = httpx.get(f"{base}/completions", timeout=TIMEOUT)
    _refused(answer, 405, "method_not_allowed", "GET /v1/completions", "POST")
    assert answer.headers["allow"] == "POST"
    answer = _post(f"{root}/health", "{}")
    _refused(answer, 405, "method_not_allowed", "POST /health", "GET")
    # Not UTF-8: FastAPI cannot read it as JSON at all.
    answer = _post(f"{base}/completions", b'{"model": "tiny", "prompt": "\xff"}')
    _refused(answer, 400, "invalid_request", "could not be read as JSON", "0xff")
    answer = _post(f"{base}/completions", '{"model": "tiny", "prompt": "x"')
    _refused(answer, 400, "invalid_request", "not valid JSON")
    _works(client)


def test_an_unexpected_error_still_gets_the_error_shape(served, monkeypatch):
    """A bug in a handler: a 500 in the error shape, not a plain-text one."""
    client, state = served

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer broke")

    monkeypatch.setattr(state.codec, "encode", broken)
    base, _ = _urls(client)
    answer = _post(f"{base}/completions", {"model": "tiny", "prompt": "x"})
    _refused(answer, 500, "internal_error", "RuntimeError: tokenizer broke")
    monkeypatch.undo()
    _works(client)
