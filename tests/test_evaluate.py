"""python -m engine.evaluate against the trainer's own validation and a hand-made reference."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint.format import write_checkpoint
from engine.evaluate import check, evaluation_config, main, worker
from engine.inference import ModelSource
from engine.models import build_model
from engine.models.config import preset
from tests.corpus import build_test_corpus
from tests.multiproc import run_ranks
from tests.test_engine import _train, tiny_run
from tests.torch_reference import tiny_gpt


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    return build_test_corpus(tmp_path_factory.mktemp("corpus"))


def _args(**flags) -> Namespace:
    defaults = dict(
        ckpt=None,
        hf_dir=None,
        data=None,
        text=None,
        tokenizer=None,
        split="valid",
        batches=None,
        micro_batch=None,
        seq_len=None,
        tp_size=1,
        dp_size=1,
        device="cpu",  # the trainer ran its ranks on the CPU too (gloo, any machine)
    )
    return Namespace(**{**defaults, **flags})


@pytest.mark.slow
def test_same_loss_as_the_trainers_validation_at_other_layouts(corpus, tmp_path, capsys):
    """Train 10 steps at tp=2 dp=2; the trainer's final validation loss is the reference.

    The checkpoint evaluated at tp=1 dp=2 (two ranks) and by the command line at tp=1 dp=1
    must give it again: same weights, same micro-batches, only the summation order of the
    TP split differs, so rtol 1e-5 (float32 reassociation over 64-wide hidden sums is
    ~1e-7 relative; 1e-5 leaves room without hiding a wrong batch, which moves the loss
    by more than 1e-3).
    """
    cfg = tiny_run(
        corpus,
        tmp_path,
        "tp_size=2",
        "dp_size=2",
        "trainer.max_steps=10",
        "trainer.eval_batches=200",  # more than the split holds: it reads on, reshuffled
        "checkpoint.every=10",
        "trainer.device=cpu",
    )
    summary = run_ranks(_train, 4, cfg, timeout=240)[0]
    reference = summary["eval"]["valid/loss"]

    root = str(tmp_path / "ckpt")
    args = _args(ckpt=root, dp_size=2)
    eval_cfg = check(args, evaluation_config(args))
    assert eval_cfg.trainer.eval_batches == 200 and eval_cfg.data.seq_len == 32
    from engine.data.pipeline import eval_iterator, load_tokenizer

    valid, _ = eval_iterator(eval_cfg, "valid", load_tokenizer(eval_cfg.data))
    assert len(valid.dataset) < 200 * 2  # the set wraps into a second epoch, as in the trainer
    got = run_ranks(worker, 2, eval_cfg, ModelSource(ckpt=root), "valid", timeout=240)[0]
    torch.testing.assert_close(got["loss"], reference, rtol=1e-5, atol=0)

    assert main(["--ckpt", root, "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    torch.testing.assert_close(result["loss"], reference, rtol=1e-5, atol=0)
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item())
    assert (result["micro_batches"], result["sequences"], result["tp_size"]) == (200, 400, 1)


def test_text_file_loss_is_the_mean_cross_entropy_of_its_windows(corpus, tmp_path, capsys):
    """--text: every window of seq_len + 1 tokens of the file (plus its end-of-document
    token) read once, one per micro-batch; the reference is F.cross_entropy of the same
    model's logits on each window, averaged by hand. float32, same forward: rtol 1e-5."""
    from tokenizers import Tokenizer

    _, tokenizer_path = corpus
    tokenizer = Tokenizer.from_file(tokenizer_path)
    cfg = tiny_gpt(tokenizer.get_vocab_size(), max_positions=64)
    torch.manual_seed(7)
    model = build_model(cfg).eval()
    export = tmp_path / "export"
    write_checkpoint(export, model.full_state_dict(), cfg, tokenizer=tokenizer_path)
    text = tmp_path / "held_out.txt"
    text.write_text("def total(items):\n    return sum(item.value for item in items)\n" * 6)

    ids = tokenizer.encode(text.read_text()).ids + [tokenizer.token_to_id("<|endoftext|>")]
    seq = 16
    windows = [ids[i * seq : i * seq + seq + 1] for i in range((len(ids) - 1) // seq)]
    with torch.no_grad():
        losses = [
            F.cross_entropy(
                model(torch.tensor([w[:-1]]))[0, :, : cfg.vocab_size], torch.tensor(w[1:])
            ).item()
            for w in windows
        ]
    reference = sum(losses) / len(losses)

    argv = [
        "--ckpt",
        str(export),
        "--text",
        str(text),
        "--seq-len",
        str(seq),
        "--micro-batch",
        "1",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sequences"] == len(windows) >= 3
    torch.testing.assert_close(result["loss"], reference, rtol=1e-5, atol=0)


def test_bad_inputs_are_one_line_and_exit_2(corpus, tmp_path, capsys):
    _, tokenizer_path = corpus
    cfg = preset("gpt_tiny", vocab_size=512, hidden_size=32, num_heads=4, max_positions=64)
    export = tmp_path / "export"
    write_checkpoint(export, build_model(cfg).full_state_dict(), cfg, tokenizer=tokenizer_path)
    short = tmp_path / "short.txt"
    short.write_text("x")
    words = tmp_path / "words.txt"
    words.write_text("def total(items): return sum(items)\n" * 4)
    cases = [
        (["--ckpt", str(export)], "records no training data: pass --data or --text"),
        (["--ckpt", str(export), "--text", str(short)], "fewer than seq_len + 1"),
        (["--ckpt", str(export), "--text", str(short), "--tp-size", "3"], "tp_size=3"),
        (["--ckpt", str(tmp_path / "nothing"), "--text", str(short)], "nothing"),
        (["--ckpt", str(export), "--batches", "0"], "--batches"),
        (
            ["--ckpt", str(export), "--text", str(words), "--seq-len", "8", "--micro-batch", "64"],
            "fewer than one micro-batch of 64",
        ),
    ]
    for argv, expected in cases:
        assert _exit_code(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (argv, err)


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse's own errors
        return stop.code
