"""python -m engine.evaluate against the trainer's own validation and a hand-made reference."""

from __future__ import annotations

import json
import struct
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint.format import write_checkpoint
from engine.data.indexed import IndexedDataset, IndexedDatasetWriter, check_token_ids
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


def _final_validation_loss(corpus, tmp_path, *overrides: str) -> float:
    """Train the tiny run with ``overrides`` on 4 CPU ranks (a layout of world 4), its
    checkpoints under ``tmp_path / "ckpt"``; the trainer's final validation loss."""
    cfg = tiny_run(corpus, tmp_path, *overrides, "trainer.device=cpu")
    return run_ranks(_train, 4, cfg, timeout=240)[0]["eval"]["valid/loss"]


@pytest.mark.slow
def test_same_loss_as_the_trainers_validation_at_other_layouts(corpus, tmp_path, capsys):
    """Train 4 steps at tp=2 dp=2; the trainer's final validation loss is the reference.

    The checkpoint evaluated at tp=1 dp=2 (two ranks) and by the command line at tp=1 dp=1
    must give it again: same weights, same micro-batches, only the summation order of the
    TP split differs, so rtol 1e-5 (float32 reassociation over 64-wide hidden sums is
    ~1e-7 relative; 1e-5 leaves room without hiding a wrong batch, which moves the loss
    by more than 1e-3).
    """
    reference = _final_validation_loss(
        corpus,
        tmp_path,
        "tp_size=2",
        "dp_size=2",
        "trainer.max_steps=4",
        # A 3 % validation split (62 sequences) and 40 micro-batches of 2 (80 sequences):
        # more than the split holds, so it reads on, reshuffled, as 200 did of the 15 %
        # split's 377, at a fifth of the forwards.
        "data.split='97,3,0'",
        "trainer.eval_batches=40",
        "checkpoint.every=4",
    )

    root = str(tmp_path / "ckpt")
    args = _args(ckpt=root, dp_size=2)
    eval_cfg = check(args, evaluation_config(args))
    assert eval_cfg.trainer.eval_batches == 40 and eval_cfg.data.seq_len == 32
    from engine.data.run_data import eval_iterator, load_tokenizer

    valid, _ = eval_iterator(eval_cfg, "valid", load_tokenizer(eval_cfg.data))
    assert len(valid.dataset) < 40 * 2  # the set wraps into a second epoch, as in the trainer
    got = run_ranks(worker, 2, eval_cfg, ModelSource(ckpt=root), "valid", timeout=240)[0]
    torch.testing.assert_close(got["loss"], reference, rtol=1e-5, atol=0)

    assert main(["--ckpt", root, "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    torch.testing.assert_close(result["loss"], reference, rtol=1e-5, atol=0)
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item())
    assert (result["micro_batches"], result["sequences"], result["tp_size"]) == (40, 80, 1)
    # The run's final export (ROOT/final) reads the run's data beside it, and gives the same
    # loss: before, it "recorded no training data" and wanted --data or --text.
    assert main(["--ckpt", str(tmp_path / "ckpt" / "final"), "--device", "cpu"]) == 0
    final = json.loads(capsys.readouterr().out)
    torch.testing.assert_close(final["loss"], reference, rtol=1e-5, atol=0)
    assert (final["micro_batches"], final["seq_len"]) == (40, 32)


@pytest.mark.slow
def test_a_run_trained_at_pp2_cp2_evaluates_at_one_rank_to_its_validation_loss(
    corpus, tmp_path, capsys
):
    """The layout a run trained at is not the one evaluate reads it at: a checkpoint of
    pp 2 × cp 2 (four ranks) evaluated on one rank gives the trainer's final validation
    loss. Before, evaluate kept the recorded pp_size and cp_size and refused ("pp_size ×
    dp_size × tp_size = 2 × 1 × 1 = 2 does not equal the world size 1"). rtol 1e-5: the
    same weights and micro-batches, summed in another order (stages, ring blocks) only."""
    layout = ("tp_size=1", "dp_size=1", "pp_size=2", "cp_size=2")
    run = ("trainer.max_steps=2", "trainer.eval_batches=4", "checkpoint.every=2")
    reference = _final_validation_loss(corpus, tmp_path, *layout, *run)
    assert main(["--ckpt", str(tmp_path / "ckpt"), "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out.strip())
    torch.testing.assert_close(result["loss"], reference, rtol=1e-5, atol=0)
    assert (result["micro_batches"], result["tp_size"], result["dp_size"]) == (4, 1, 1)
    # tools/checkpoint.py inspect names the axes that make the world of 4 (before, it
    # said "tp=1 dp=1 (world 4)": the index kept no cp size and the line no pp one).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import checkpoint as checkpoint_cli  # tools/checkpoint.py

    assert checkpoint_cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line == "layout: tp=1 dp=1 pp=2 cp=2 (world 4), dp_shard=none", line
    # Converted, it is a tp × dp checkpoint that remembers the layout it came from.
    out = tmp_path / "tp1"
    args = ["convert", str(tmp_path / "ckpt"), "--tp-size", "1", "--dp-size", "1", str(out)]
    assert checkpoint_cli.main(args) == 0
    assert checkpoint_cli.main(["inspect", str(out)]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line == "layout: tp=1 dp=1 (world 1), dp_shard=none, converted from tp=1 dp=1 pp=2 cp=2"


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

    # A text shorter than the run's sequences (here 64 tokens) is one sequence, whole: it
    # was refused ("fewer than --seq-len + 1"), naming a temporary directory and splits.
    short = tmp_path / "short.txt"
    short.write_text("def total(items):\n")
    ids = tokenizer.encode(short.read_text()).ids + [tokenizer.token_to_id("<|endoftext|>")]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0, :, : cfg.vocab_size]
        whole = F.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert main(["--ckpt", str(export), "--text", str(short), "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["seq_len"], result["sequences"]) == (len(ids) - 1, 1) and len(ids) < 20
    torch.testing.assert_close(result["loss"], whole, rtol=1e-5, atol=0)


def test_bad_inputs_are_one_line_and_exit_2(corpus, tmp_path, capsys):
    prefix, tokenizer_path = corpus
    cfg = preset("gpt_tiny", vocab_size=512, hidden_size=32, num_heads=4, max_positions=64)
    export = tmp_path / "export"
    write_checkpoint(export, build_model(cfg).full_state_dict(), cfg, tokenizer=tokenizer_path)
    short = tmp_path / "short.txt"
    short.write_text("x")
    words = tmp_path / "words.txt"
    words.write_text("def total(items): return sum(items)\n" * 4)
    from transformers import GPT2Config

    no_weights = tmp_path / "hf_config_only"  # a Hugging Face directory without its weights
    GPT2Config(
        vocab_size=512, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0
    ).save_pretrained(no_weights)
    capsys.readouterr()  # only what evaluate prints below
    cases = [
        (  # two ranks: before, each raised it, and the launcher printed their tracebacks
            ["--hf-dir", str(no_weights), "--tokenizer", tokenizer_path, "--text", str(words)]
            + ["--seq-len", "8", "--micro-batch", "1", "--dp-size", "2"],
            "hf_config_only has no model.safetensors (only safetensors is read)",
        ),
        (["--ckpt", str(export)], "records no training data: pass --data or --text"),
        (
            ["--ckpt", str(export), "--text", str(short), "--seq-len", "8"],
            "short.txt holds 2 tokens with its document end: --seq-len 8 needs 9; pass "
            "--seq-len 1 or less",
        ),
        (
            ["--ckpt", str(export), "--text", str(short), "--tp-size", "3"],
            "is not divisible by --tp-size 3",
        ),
        (["--ckpt", str(tmp_path / "nothing"), "--text", str(short)], "nothing"),
        (["--ckpt", str(export), "--batches", "0"], "--batches"),
        (["--ckpt", str(export), "--text", "def f(): pass"], "--text def f(): pass: no such file"),
        (  # 949,50,1 of the test corpus's documents leaves none to the test split
            ["--ckpt", str(export), "--data", prefix, "--split", "test"],
            "hold 0 tokens, fewer than --seq-len + 1 = 65; read another --split (data.split=",
        ),
        (
            ["--ckpt", str(export), "--text", str(words), "--seq-len", "8", "--micro-batch", "64"],
            "fewer than one micro-batch of 64",
        ),
    ]
    for argv, expected in cases:
        assert _exit_code(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (argv, err)


@pytest.mark.slow
def test_a_terminal_sees_the_forwards_counted_and_stdout_holds_only_the_json(
    corpus, tmp_path, capsys
):
    """Long evaluations show progress: with stderr a terminal (a pseudo-terminal here) a
    bar counts the forwards up to all of them ("n/n", n the micro-batches the JSON
    reports); stdout still holds the JSON line alone, and stderr that is no terminal gets
    no bar."""
    import os
    import pty
    import subprocess
    import sys

    from tests.launch_util import env_with_repo

    _, tokenizer_path = corpus
    cfg = preset("gpt_tiny", vocab_size=512, hidden_size=32, num_heads=4, max_positions=64)
    export = tmp_path / "export"
    write_checkpoint(export, build_model(cfg).full_state_dict(), cfg, tokenizer=tokenizer_path)
    words = tmp_path / "words.txt"
    words.write_text("def total(items): return sum(items)\n" * 20)
    argv = ["--ckpt", str(export), "--text", str(words), "--seq-len", "8", "--micro-batch", "1"]
    argv += ["--device", "cpu"]
    main_fd, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.evaluate", *argv],
        stdout=subprocess.PIPE,
        stderr=terminal,
        env=env_with_repo(TERM="xterm"),
        cwd=tmp_path,
    )
    os.close(terminal)
    screen = b""
    while True:  # until every holder of the terminal's other end has closed it
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # EIO: the other end is closed
            break
        if not chunk:
            break
        screen += chunk
    os.close(main_fd)
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=60) == 0, screen.decode(errors="replace")[-2000:]
    result = json.loads(out)  # the whole of stdout: one JSON object
    n = result["micro_batches"]
    shown = screen.decode(errors="replace")
    assert n >= 10 and "evaluate" in shown and f"{n}/{n}" in shown, shown[-2000:]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["loss"] == result["loss"]
    assert "evaluate" not in captured.err and f"/{n}" not in captured.err, captured.err


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse's own errors
        return stop.code


# Token ids past the model's vocabulary (issue 39): at tp >= 2 a vocab-parallel shard's
# lookup of such an id reads nothing and the loss looks plausible; at tp = 1 it fails mid-run.
_MAX_TOKEN_AT = 48  # byte offset of max_token in a meshtron .idx (after the 40-byte header)


def _ids_up_to(prefix: Path, top: int, eod: int, vocab: int = 1000) -> None:
    """A meshtron pair of 40 documents with ids 0 .. ``top`` (``top`` itself included)."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, vocab_size=vocab, eod_id=eod) as writer:
        for _ in range(40):
            writer.add_document(np.append(rng.integers(0, top, 100), top))


def _set_max_token(prefix: Path, value: int) -> None:
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    struct.pack_into("<q", raw, _MAX_TOKEN_AT, value)
    Path(f"{prefix}.idx").write_bytes(bytes(raw))


def _as_version_2(prefix: Path) -> None:
    """Rewrite ``PREFIX.idx`` as the version 2 writer did: no trailing index checksum."""
    raw = Path(f"{prefix}.idx").read_bytes()
    if struct.unpack_from("<I", raw, 8)[0] == 2:
        return  # written by a version 2 writer already
    Path(f"{prefix}.idx").write_bytes(raw[:8] + struct.pack("<I", 2) + raw[12:-32])


def test_an_index_whose_id_range_lies_is_refused(tmp_path):
    """The header claims a largest id of 300 where the .bin holds 899, which a 512-id
    vocabulary would have passed: verify() reads the ids with the checksum and refuses,
    naming the file and both ranges. A damaged index checksum is refused too."""
    prefix = tmp_path / "liar"
    _ids_up_to(prefix, 899, eod=1)
    assert IndexedDataset(prefix).token_range == (0, 899)
    IndexedDataset(prefix).verify(1000)
    _set_max_token(prefix, 300)
    with pytest.raises(ValueError, match=r"liar.idx: records token ids 0\.\.300 but liar.bin"):
        check_token_ids(prefix, 512)
    _set_max_token(prefix, 899)
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[-1] ^= 1
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="liar.idx: header or document offsets do not match"):
        check_token_ids(prefix, 1000)


def test_a_version_2_index_still_loads_and_its_range_is_checked_against_the_data(tmp_path):
    """A version 2 index (range recorded, no checksum over it) loads and verifies; one whose
    recorded range lies is refused by verify(), which reads the ids while it hashes."""
    prefix = tmp_path / "old"
    _ids_up_to(prefix, 899, eod=1)
    _as_version_2(prefix)
    old = IndexedDataset(prefix)
    assert (old.version, old.token_range) == (2, (0, 899))
    old.verify(1000)
    _set_max_token(prefix, 300)
    with pytest.raises(ValueError, match=r"records token ids 0\.\.300 but old.bin holds 0\.\.899"):
        IndexedDataset(prefix).verify(1000)
    _set_max_token(prefix, 899)  # an honest header again: a smaller vocabulary refuses it
    with pytest.raises(
        ValueError, match=r"old.bin: token ids 0\.\.899, outside the model's vocabulary of 512"
    ):
        check_token_ids(prefix, 512)


@pytest.mark.parametrize("tp", [1, 2])
def test_evaluate_refuses_ids_past_the_vocabulary_before_any_rank(corpus, tmp_path, tp, capsys):
    """--data made with a larger vocabulary: one line naming the .bin, its largest id and
    the model's vocabulary, exit 2, and no rank started (a traceback at tp=1 and a
    plausible loss at tp=2 before)."""
    from tokenizers import Tokenizer

    import engine.evaluate
    import engine.launching

    _, tokenizer_path = corpus
    tokenizer = Tokenizer.from_file(tokenizer_path)
    vocab = tokenizer.get_vocab_size()
    cfg = preset("gpt_tiny", vocab_size=vocab, hidden_size=32, num_heads=4, max_positions=64)
    export = tmp_path / "export"
    write_checkpoint(export, build_model(cfg).full_state_dict(), cfg, tokenizer=tokenizer_path)
    prefix = tmp_path / "wide"
    _ids_up_to(prefix, vocab + 100, eod=tokenizer.token_to_id("<|endoftext|>"), vocab=2 * vocab)

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank started")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.evaluate, "worker", no_rank)
        mp.setattr(engine.launching, "launch_workers", no_rank)
        argv = ["--ckpt", str(export), "--data", str(prefix), "--seq-len", "32"]
        assert _exit_code([*argv, "--tp-size", str(tp), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{prefix}.bin: token ids 0..{vocab + 100}, outside" in err
    assert f"vocabulary of {vocab} ids" in err


def test_hf_dir_loss_is_transformers_own_loss(corpus, tmp_path, capsys):
    """--hf-dir: a random 2-layer GPT-2 saved by transformers, loaded by the function
    tools/generate.py uses (ModelSource.load → read_hf_dir). Its loss over every window of a
    text file must be the mean cross-entropy of GPT2LMHeadModel's own logits on the same
    windows. float32 in both, different kernels (attention, GELU-tanh, layer norm): rtol 1e-5
    (reassociation over 32-wide sums is ~1e-7; a wrong weight or shift moves it by > 1e-2).
    No --seq-len: with no recorded run it is the data default capped at the model's 32
    positions (the default 128 used to fail mid-run, past GPT-2's position table)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    _, tokenizer_path = corpus
    tokenizer = Tokenizer.from_file(tokenizer_path)
    torch.manual_seed(11)
    hf_cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=tokenizer.get_vocab_size()
    )
    hf_model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    text = tmp_path / "held_out.txt"
    text.write_text("def scale(width, height):\n    return width * height // 7\n" * 12)

    ids = tokenizer.encode(text.read_text()).ids + [tokenizer.token_to_id("<|endoftext|>")]
    seq = hf_cfg.n_positions
    windows = [ids[i * seq : i * seq + seq + 1] for i in range((len(ids) - 1) // seq)]
    with torch.no_grad():
        # seq + 1 tokens would not fit 32 positions: transformers' logits of the first seq,
        # scored against the next token of each.
        losses = [
            F.cross_entropy(hf_model(torch.tensor([w[:-1]])).logits[0], torch.tensor(w[1:])).item()
            for w in windows
        ]
    reference = sum(losses) / len(losses)

    argv = ["--hf-dir", str(tmp_path / "hf"), "--tokenizer", tokenizer_path, "--text", str(text)]
    assert main([*argv, "--micro-batch", "1", "--device", "cpu"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert (result["sequences"], result["seq_len"]) == (len(windows), seq)
    assert len(windows) >= 3
    torch.testing.assert_close(result["loss"], reference, rtol=1e-5, atol=0)
