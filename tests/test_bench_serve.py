"""tools/bench_serve.py at a tiny size: what must hold on any machine, never a timing.

The tool starts ``python -m apps.serve`` as a subprocess on a tiny random GPT it builds
(init std 0.2, so greedy tokens do not depend on a batch's float32 rounding), sends the
requests from concurrent HTTP clients, and runs the same requests through the serving
engine continuously and in static batches. Every request must be answered exactly once,
and every run's tokens (the server's decoded text) must equal sequential generation's.
"""

from __future__ import annotations

import json

import pytest

from studies.bench.serve import main

TINY = [
    "--clients",
    "4",
    "--requests",
    "8",
    "--batch",
    "4",
    "--hidden",
    "32",
    "--vocab",
    "300",
    "--positions",
    "128",
    "--prompt-tokens",
    "4",
    "24",
    "--max-tokens",
    "4",
    "8",
    "16",
]


@pytest.mark.slow  # a server subprocess and a tokenizer trained on the corpus: ~15 s
def test_every_request_answered_once_with_the_sequential_tokens(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main([*TINY, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    names = [r["name"].split(" (")[0] for r in results["runs"]]
    assert names == [
        "server, continuous",
        "server, static",
        "engine, continuous",
        "engine, static",
        "generate_batch, static",
        "transformers generate, static",
        "sequential, batch 1",
    ]
    for run in results["runs"]:
        assert run["problems"] == [], run["name"]
        assert run["answered"] == 8, run["name"]
    # Every run generated the same tokens: the sum of the requests' max_tokens.
    assert len({run["generated"] for run in results["runs"]}) == 1
    out = capsys.readouterr().out
    assert "| server, continuous (4 clients, max running 4) | 8 |" in out
    assert "| server, static (batches of 4) | 8 |" in out
    assert "over HTTP, continuous ÷ static batching: " in out


def test_bad_flags_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--prompt-tokens", "9", "3"])
    assert stop.value.code == 2
    assert "--prompt-tokens: MIN 9 > MAX 3" in capsys.readouterr().err


def test_the_token_check_catches_a_wrong_and_a_missing_answer():
    from studies.bench.serve import Run, Work, check

    work = [Work(0, [1, 2], 2), Work(1, [3], 1), Work(2, [4], 1)]
    reference = Run("sequential", tokens={0: [5, 6], 1: [7], 2: [8]})
    run = Run("other", tokens={0: [5, 6], 1: [9]})
    check(run, work, reference)
    assert run.problems == [
        "request 1: tokens differ from sequential",
        "request 2: no tokens",
    ]


def test_the_default_mix_shrinks_to_the_models_positions_and_a_given_one_stays():
    from studies.bench.serve import fit_mix, parse_args

    args = parse_args([])
    fit_mix(args, 256)
    assert (args.max_tokens, args.prompt_tokens) == ([8, 16, 32, 64, 128], [8, 96])
    args = parse_args([])
    fit_mix(args, 128)  # the quick start's checkpoint
    assert (args.max_tokens, args.prompt_tokens) == ([8, 16, 32, 64], [8, 64])
    args = parse_args(["--max-tokens", "100", "--prompt-tokens", "3", "5"])
    fit_mix(args, 128)
    assert (args.max_tokens, args.prompt_tokens) == ([100], [3, 5])


@pytest.mark.slow  # a server subprocess: ~10 s
def test_a_relative_ckpt_reaches_the_server(tmp_path, monkeypatch, capsys):
    """--ckpt relative to where the tool runs: the server it starts runs in the checkout,
    and before it was handed the path as given (it found no model there and exited
    before serving). Every request is answered once, with the sequential tokens."""
    from tests.test_serve import make_export

    make_export(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    flags = [*TINY, "--requests", "4", "--ckpt", "tiny", "--json", "serve.json"]
    assert main(flags) == 0
    runs = json.loads((tmp_path / "serve.json").read_text())["runs"]
    served = [r for r in runs if r["name"].startswith("server, ")]
    assert len(served) == 2, [r["name"] for r in runs]
    for run in runs:
        assert run["problems"] == [] and run["answered"] == 4, run
