"""Bad command-line values of tools/generate.py and engine.evaluate (issue 39): each is one
line naming the flag, the value and the allowed range, exit 2, before any rank starts.

Before, nan and inf temperatures, a seed past 2**64 - 1 and an empty --stop got past the
parser: nan and the seed became tracebacks in the rank, inf sampled uniformly and ''
ended every sample after one token; --batches 10**9 and --micro-batch 10**12 made
evaluate run (or allocate) without bound.
"""

from __future__ import annotations

import math

import pytest
import torch

import apps.generate_text
import engine.evaluate
import engine.launching
from engine.checkpoint.format import write_checkpoint
from engine.generate import Sampling, generate_batch
from engine.models import build_model
from engine.models.config import preset
from tests.corpus import build_test_corpus
from tests.test_generate_tool import _export


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    directory, _, _ = _export(tmp_path_factory.mktemp("generate"))
    return str(directory)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[str, str]:
    """(model export, data prefix): a 4-head tiny GPT over the test corpus's tokenizer."""
    tmp = tmp_path_factory.mktemp("evaluate")
    prefix, tokenizer_path = build_test_corpus(tmp)
    cfg = preset("gpt_tiny", vocab_size=512, hidden_size=32, num_heads=4, max_positions=64)
    export = tmp / "export"
    write_checkpoint(export, build_model(cfg).full_state_dict(), cfg, tokenizer=tokenizer_path)
    return str(export), prefix


@pytest.fixture
def no_rank(monkeypatch):
    """Fail the test if a rank (in this process or launched) would start."""

    def started(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr(apps.generate_text, "worker", started)
    monkeypatch.setattr(engine.evaluate, "worker", started)
    monkeypatch.setattr(engine.launching, "launch_workers", started)


def _refused(main, argv: list[str], capsys) -> str:
    """The one stderr line of ``main(argv)``, asserting exit status 2."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, code, err)
    assert len(err.splitlines()) == 1, (argv, err)
    return err


GENERATE = [
    (["--temperature", "nan"], "argument --temperature: nan must be a finite number >= 0"),
    (["--temperature", "inf"], "argument --temperature: inf must be a finite number >= 0"),
    (["--temperature", "-1"], "argument --temperature: -1 must be a finite number >= 0"),
    (["--temperature", "warm"], "argument --temperature: 'warm' is not a number"),
    (["--seed", str(2**70)], f"argument --seed: {2**70} must be in 0 .. 2**64 - 1"),
    (["--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["--top-k", "-1"], "argument --top-k: -1 must be >= 0"),
    (["--top-p", "1.5"], "argument --top-p: 1.5 must be in (0, 1]"),
    (["--top-p", "nan"], "argument --top-p: nan must be in (0, 1]"),
    (["--top-p", "0"], "argument --top-p: 0 must be in (0, 1]"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: 0 must be >= 1"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: -1 must be >= 1"),
    (["--max-new-tokens", "1.5"], "argument --max-new-tokens: '1.5' is not an integer"),
    (["--max-new-tokens", str(10**12)], f"--max-new-tokens {10**12} after a prompt of"),
    (["--stop", ""], "argument --stop: '' must not be empty"),
    (["--tp-size", "0"], "argument --tp-size: 0 must be >= 1"),
    (["--prompt", ""], "argument --prompt: '' must not be empty"),
]


@pytest.mark.parametrize(("flags", "expected"), GENERATE, ids=[" ".join(c[0]) for c in GENERATE])
def test_generate_refuses_a_bad_value_in_one_line(export, flags, expected, no_rank, capsys):
    argv = ["--ckpt", export, "--prompt", "def add", *flags]
    assert expected in _refused(apps.generate_text.main, argv, capsys)


def test_the_good_values_pass_the_same_checks(export):
    """The control: the same command with in-range values at each end passes check()."""
    argv = ["--ckpt", export, "--prompt", "def add", "--temperature", "1e-3", "--top-k", "0"]
    argv += ["--top-p", "1", "--seed", str(2**64 - 1), "--stop", "\n", "--max-new-tokens", "8"]
    assert apps.generate_text.check(apps.generate_text.parse_args(argv)).endswith(".json")


def test_temperature_0_is_argmax_as_in_the_server(export):
    """``--temperature 0`` means argmax, as a request's temperature 0 does (and OpenAI's);
    it was refused. Against torch.argmax over logits where sampling at the default
    temperature would pick other tokens."""
    from engine.generate import next_tokens

    argv = ["--ckpt", export, "--prompt", "def add", "--temperature", "0", "--top-k", "0"]
    chosen = apps.generate_text.sampling(apps.generate_text.parse_args(argv))
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3))
    picked = next_tokens(logits, chosen, torch.Generator().manual_seed(4))
    assert torch.equal(picked, logits.argmax(dim=-1))


def test_sampling_refuses_what_the_flags_refuse():
    """Programmatic callers get the same ranges from Sampling.check and generate_batch."""
    model = build_model(preset("gpt_tiny", vocab_size=64, hidden_size=32, num_heads=4))
    bad = [
        (Sampling(temperature=math.nan), "temperature must be > 0 and finite, got nan"),
        (Sampling(temperature=math.inf), "temperature must be > 0 and finite, got inf"),
        (Sampling(seed=2**64), "seed must be in 0 .. 2**64 - 1"),
        (Sampling(seed=-1), "seed must be in 0 .. 2**64 - 1"),
    ]
    for sampling, message in bad:
        with pytest.raises(ValueError, match=message.replace("*", r"\*")):
            generate_batch(model, [[1]], 1, sampling)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        generate_batch(model, [[1]], -1, Sampling(greedy=True))
    assert generate_batch(model, [[1]], 1, Sampling(seed=2**64 - 1)) != [[]]


def test_a_tiny_temperature_samples_the_argmax():
    """1e-300 is a valid temperature: it used to overflow the largest logit to inf and the
    sampler to raise on nan probabilities; in the limit it is greedy."""
    import torch

    from engine.generate import next_tokens

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, -2.0, 0.0, 0.99]])
    generator = torch.Generator().manual_seed(0)
    for temperature in (1e-300, 5e-324, 1e-30):
        got = next_tokens(logits, Sampling(temperature=temperature), generator)
        assert got.tolist() == [1, 0]


EVALUATE = [
    (["--batches", str(10**9)], f"--batches {10**9}: the valid split holds"),
    (["--micro-batch", str(10**12)], f"fewer than one micro-batch of {10**12}"),
    (["--seq-len", str(10**6)], f"--seq-len {10**6}: the model has 64 positions"),
    (["--dp-size", "1000"], "--dp-size 1000: more data-parallel ranks than the"),
    (["--batches", "-3"], "argument --batches: -3 must be >= 1"),
    (["--tp-size", "0"], "argument --tp-size: 0 must be >= 1"),
    (["--split", "dev"], "argument --split: invalid choice: 'dev'"),
    (["--tokenizer", __file__], "test_bad_tool_args.py is not a tokenizer.json ("),
]


@pytest.mark.parametrize(("flags", "expected"), EVALUATE, ids=[" ".join(c[0]) for c in EVALUATE])
def test_evaluate_refuses_a_bad_value_in_one_line(evaluated, flags, expected, no_rank, capsys):
    export, prefix = evaluated
    argv = ["--ckpt", export, "--data", prefix, "--seq-len", "32", "--device", "cpu", *flags]
    assert expected in _refused(engine.evaluate.main, argv, capsys)


def test_evaluate_batches_up_to_what_the_split_holds_are_read(evaluated, no_rank, capsys):
    """The control: as many micro-batches as the error above names is accepted."""
    export, prefix = evaluated
    argv = ["--ckpt", export, "--data", prefix, "--seq-len", "32", "--device", "cpu"]
    err = _refused(engine.evaluate.main, [*argv, "--batches", str(10**9)], capsys)
    held = int(err.split("pass --batches ")[1].split()[0])
    args = engine.evaluate.parse_args([*argv, "--batches", str(held)])
    cfg = engine.evaluate.check(args, engine.evaluate.evaluation_config(args))
    assert cfg.trainer.eval_batches == held


def test_output_path_types_refuse_what_cannot_be_written(tmp_path):
    """engine.tool_args.output_file / output_dir, the benchmarks' --out, --json and --dir:
    a path no run could write is refused while parsing, and the check leaves nothing."""
    import argparse
    import re

    from engine.tool_args import output_dir, output_file

    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    bad = [
        (output_file, "/proc/x/s.json", "its folder /proc/x does not exist"),
        (output_file, f"{a_file}/s.json", f"its folder {a_file} is not a directory"),
        (output_file, str(tmp_path), f"{tmp_path} is a directory; give a file path"),
        (output_file, "", "'' must not be empty"),
        (output_dir, str(a_file), f"{a_file} is a file; give a directory"),
        (output_dir, "/proc/x/d", "/proc/x cannot be written"),
    ]
    for check, text, message in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            check(text)
    assert output_file(str(a_file)) == str(a_file) and a_file.read_text() == "kept"
    assert output_file(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    assert output_dir(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new" / "deeper")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing left behind
