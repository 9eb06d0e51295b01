"""tools/generate.py end to end: an exported model and its tokenizer, sampled at tp=2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine.checkpoint.format import write_checkpoint
from engine.generate import Sampling, generate_batch
from engine.models import build_model, preset
from tests.launch_util import run
from tests.torch_reference import tiny_gpt

REPO = Path(__file__).resolve().parents[1]


def _tool(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, str(REPO / "tools" / "generate.py"), *args], None, 300)


def _tool_main(tool: str = "generate"):
    """``tools/<tool>.py``'s main, imported in-process (no interpreter start-up per call)."""
    spec = importlib.util.spec_from_file_location(f"{tool}_tool", REPO / "tools" / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _export(tmp_path: Path) -> tuple[Path, Tokenizer, object]:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    cfg = tiny_gpt(tokenizer.get_vocab_size(), max_positions=64)
    torch.manual_seed(3)
    model = build_model(cfg)
    directory = tmp_path / "export"
    write_checkpoint(directory, model.full_state_dict(), cfg)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, tokenizer, model


@pytest.mark.slow
def test_tool_at_tp2_prints_what_tp1_generates_in_process(tmp_path):
    directory, tokenizer, model = _export(tmp_path)
    prompts = ["def add", "return a"]
    out = _tool(
        "--ckpt",
        str(directory),
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--greedy",
        "--max-new-tokens",
        "6",
        "--tp-size",
        "2",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ids = generate_batch(
        model, [tokenizer.encode(p).ids for p in prompts], 6, Sampling(greedy=True)
    )
    expected = []
    for i, (prompt, new) in enumerate(zip(prompts, ids, strict=True)):
        expected += [f"--- sample {i + 1} ---", prompt + tokenizer.decode(new)]
    assert out.stdout.splitlines() == "\n".join(expected).splitlines()
    assert "tokens/s, tp=2, KV cache on" in out.stderr


def test_tool_rejects_a_bad_layout_and_a_missing_tokenizer_in_one_line(tmp_path, capsys):
    directory, _, _ = _export(tmp_path)
    main = _tool_main()
    assert main(["--ckpt", str(directory), "--prompt", "x", "--tp-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "generate: model.num_heads=4 is not divisible by --tp-size 3"
    (directory / "tokenizer.json").unlink()
    assert main(["--ckpt", str(directory), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --tokenizer PATH" in err
    assert main(["--ckpt", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nothing" in err
    # An encoder is refused naming every family that generates (gemma was once missing).
    bert = tmp_path / "bert"
    bert_cfg = preset("bert_tiny", vocab_size=300, hidden_size=32, num_heads=4, num_layers=1)
    write_checkpoint(bert, build_model(bert_cfg).full_state_dict(), bert_cfg)
    assert main(["--ckpt", str(bert), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"generate: {bert} holds a bert model; only decoders (gpt, llama, gemma) generate"
    )


def _trained_checkpoint(tmp_path: Path) -> tuple[Path, Path, object]:
    """A training checkpoint root (one step, no optimizer) whose run recorded the tokenizer
    the trainer records: path and SHA-256 of the BPE engine.data.preprocess trains."""
    from engine.checkpoint import save_checkpoint
    from engine.checkpoint.tokenizer import tokenizer_record
    from engine.data.preprocess import save_tokenizer, train_tokenizer

    tokenizer_path = tmp_path / "data" / "corpus.tokenizer.json"
    tokenizer_path.parent.mkdir()
    save_tokenizer(
        train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300), tokenizer_path
    )
    cfg = tiny_gpt(300, max_positions=64)
    torch.manual_seed(3)
    model = build_model(cfg)
    root = tmp_path / "ckpt"
    state = {"tokenizer": tokenizer_record(tokenizer_path)}
    save_checkpoint(root, 1, model=model, optimizer=None, ps=None, state=state)
    return root, tokenizer_path, model


def test_exports_carry_the_tokenizer_so_generation_needs_no_flag(tmp_path, capsys):
    """export-model and convert_hf export write the training tokenizer beside the weights;
    generate.py reads either with no --tokenizer and prints the in-process reference's text,
    and transformers' AutoTokenizer opens the Hugging Face export with the same ids."""
    from transformers import AutoTokenizer

    root, tokenizer_path, model = _trained_checkpoint(tmp_path)
    weights, hf_dir = tmp_path / "weights", tmp_path / "hf"
    checkpoint_main, convert_main = _tool_main("checkpoint"), _tool_main("convert_hf")
    assert checkpoint_main(["export-model", str(root), "--out", str(weights)]) == 0
    assert "with its tokenizer.json" in capsys.readouterr().out
    assert (weights / "tokenizer.json").read_bytes() == tokenizer_path.read_bytes()
    assert convert_main(["export", "--ckpt", str(weights), "--out", str(hf_dir)]) == 0
    assert "with tokenizer" in capsys.readouterr().out

    reference = Tokenizer.from_file(str(tokenizer_path))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    text = "def add(a, b):\n    return a"
    assert hf_tokenizer(text)["input_ids"] == reference.encode(text).ids
    assert hf_tokenizer.eos_token == "<|endoftext|>"
    assert hf_tokenizer.eos_token_id == reference.token_to_id("<|endoftext|>")
    config = json.loads((hf_dir / "config.json").read_text())  # not GPT-2's 50256
    assert config["eos_token_id"] == config["bos_token_id"] == hf_tokenizer.eos_token_id

    new = generate_batch(model, [reference.encode("def add").ids], 5, Sampling(greedy=True))
    expected = ["--- sample 1 ---", "def add" + reference.decode(new[0])]
    main = _tool_main()
    for source in (["--ckpt", str(root)], ["--ckpt", str(weights)], ["--hf-dir", str(hf_dir)]):
        assert main([*source, "--prompt", "def add", "--greedy", "--max-new-tokens", "5"]) == 0
        assert capsys.readouterr().out.splitlines() == expected, source


def test_a_replaced_tokenizer_is_refused_by_its_recorded_hash(tmp_path, capsys):
    """The checkpoint records the tokenizer's SHA-256: a different file at that path would
    give other ids, so generation stops with one line naming it."""
    from engine.data.preprocess import save_tokenizer, train_tokenizer

    root, tokenizer_path, _ = _trained_checkpoint(tmp_path)
    save_tokenizer(train_tokenizer(["other text entirely\n"] * 20, 300), tokenizer_path)
    assert _tool_main()(["--ckpt", str(root), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "not the tokenizer this model was trained with" in err and str(tokenizer_path) in err


@pytest.mark.slow
def test_a_pipelined_run_names_the_command_that_samples_its_model(tmp_path):
    """pp 2 writes no closing sample (generation runs unpipelined); its line names the
    command that samples the exported model instead, and that command, run as printed
    (from the run's directory), generates from it."""
    import shlex

    from tests.corpus import build_test_corpus
    from tests.launch_util import tiny_overrides

    overrides = tiny_overrides(build_test_corpus(tmp_path), tmp_path, max_steps=2)
    overrides += ["checkpoint.save_final=true", "trainer.sample_tokens=4"]
    cmd = [sys.executable, "-m", "engine.pretrain", "pp_size=2", "tp_size=1", "dp_size=1"]
    done = run([*cmd, *overrides, "trainer.micro_batch=1"], tmp_path, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("no sample: "))
    assert line.startswith("no sample: generation runs unpipelined (pp_size=1); python "), line
    printed = shlex.split(line.split("; ", 1)[1].removesuffix(" samples it"))
    assert printed[:3] == ["python", "tools/generate.py", "--ckpt"], line
    sampled = run(
        [
            sys.executable,
            str(REPO / printed[1]),
            *printed[2:],
            "--prompt",
            "def",
            "--max-new-tokens",
            "3",
        ],
        tmp_path,
        300,
    )
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert sampled.stdout.startswith("--- sample 1 ---\ndef"), sampled.stdout
    assert "3 new tokens" in sampled.stderr, sampled.stderr
