"""Hugging Face interop: bitwise round trips, logits parity with transformers at TP 1 and 2,
and the command-line tools. Models are tiny random GPT-2 / BERT configs saved locally; the
vocabulary (1001) does not divide by the TP size, so the padding path is exercised.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import parallel_state
from engine.hf_interop import export_hf, import_hf, read_hf_dir
from studies.verification.hf_parity import HF_TOLERANCES, compare_with_hf
from studies.verification.layouts import VerifySpec
from tests.launch_util import run
from tests.multiproc import run_ranks

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    # Both: two layers of 4 heads on width 48, a 1001-token vocabulary, 32 positions.
    gpt2 = dict(n_embd=48, n_layer=2, n_head=4, vocab_size=1001, n_positions=32)
    gpt = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**gpt2, bos_token_id=0, eos_token_id=0)
    )
    bert_shape = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4)
    bert_config = transformers.BertConfig(
        **bert_shape, intermediate_size=96, vocab_size=1001, max_position_embeddings=32
    )
    bert = transformers.BertForPreTraining(bert_config)
    dirs = {}
    for name, model in (("gpt", gpt), ("bert", bert)):
        # Random LayerNorm parameters and biases, so a swapped or dropped one shows up.
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if param_name.endswith("weight") else 0.0, 0.1)
        dirs[name] = str(root / name)
        model.save_pretrained(dirs[name])
    return dirs


def test_round_trip_is_bitwise(hf_dirs, tmp_path):
    for name, hf_dir in hf_dirs.items():
        import_hf(hf_dir, tmp_path / f"{name}-ckpt")
        export_hf(tmp_path / f"{name}-ckpt", tmp_path / f"{name}-hf")
        before = load_file(f"{hf_dir}/model.safetensors")
        after = load_file(str(tmp_path / f"{name}-hf" / "model.safetensors"))
        assert before.keys() == after.keys()
        for key in before:
            assert before[key].dtype == after[key].dtype, key
            assert torch.equal(before[key], after[key]), key
        exported_config = json.loads((tmp_path / f"{name}-hf" / "config.json").read_text())
        assert exported_config == json.loads(Path(hf_dir, "config.json").read_text())


def _parity(hf_dirs: dict[str, str]) -> list[tuple[str, str, float, bool]]:
    results = []
    # TP 2 (vocabulary block per rank, with and without sequence parallelism) and TP 1 with
    # the batch split over DP 2; float64 shows the conversion itself is exact, also with
    # meshtron's side compiled (verify_equivalence --compile; aot_eager traces as inductor).
    layouts = [
        (2, 1, False, "float32", None),
        (2, 1, True, "float32", None),
        (1, 2, False, "float32", None),
        (2, 1, False, "float64", None),
        (2, 1, True, "float64", "aot_eager"),
    ]
    for tp, dp, sp, dtype, backend in layouts:
        parallel_state.initialize(tp, dp)
        for name, hf_dir in hf_dirs.items():
            spec = VerifySpec(
                tp_size=tp, dp_size=dp, sequence_parallel=sp, dtype=dtype, compile=backend
            )
            report = compare_with_hf(spec, hf_dir)
            if report is not None:
                compiled = f" compiled {backend}" if backend else ""
                label = f"{name} tp={tp} dp={dp} sp={sp}{compiled} {dtype}"
                results += [(label, row.name, row.max_abs, row.ok) for row in report.rows]
        parallel_state.destroy()
    return results


@pytest.mark.slow
def test_logits_match_transformers(hf_dirs):
    results = run_ranks(_parity, 2, hf_dirs, timeout=300)[0]
    for label, logits, err, _ in results:
        print(f"{label:32s} {logits:10s} max abs error {err:.2e}")
    # Absolute, studies.verification.hf_parity.HF_TOLERANCES: fp32 1e-4 (~1e-7 per op in another
    # summation order, on logits of order 1, while a misplaced weight gives O(0.1-1));
    # fp64 1e-8 (errors ~1e-15: the conversion itself is exact).
    for label, logits, err, ok in results:
        assert ok and err <= HF_TOLERANCES[label.split()[-1]], (label, logits, err)
    assert len(results) == 15


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    """``tool`` (a path under the repository) run from a scratch directory, so that nothing
    it writes by a relative path lands in the checkout."""
    with tempfile.TemporaryDirectory() as cwd:
        return run([sys.executable, str(REPO / tool), *args], cwd, 300, unset=("RANK",))


@pytest.mark.slow
def test_command_line_tools(hf_dirs, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    imported = _run("tools/convert_hf.py", "import", "--hf-dir", hf_dirs["gpt"], "--out", str(ckpt))
    assert imported.returncode == 0, imported.stderr
    exported = _run("tools/convert_hf.py", "export", "--ckpt", str(ckpt), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    # Each names the Hugging Face class it read or wrote, as its config.json does.
    assert imported.stdout.startswith("imported gpt (GPT2LMHeadModel): "), imported.stdout
    assert exported.stdout.startswith("exported gpt (GPT2LMHeadModel): "), exported.stdout
    # The verifier starts its own 2 workers (elastic launcher) and ends with the error line.
    verified = _run(
        "tools/verify_equivalence.py",
        "--hf-dir",
        str(out),
        "--tp-size",
        "2",
        "--sequence-parallel",
        "--dtype",
        "float32",
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    last = verified.stdout.strip().splitlines()[-1]
    assert last.startswith("max abs logit error: "), last
    assert float(last.split(": ")[1]) <= 1e-4


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_single_file_wins_over_stale_index_and_export_refuses_a_full_dir(hf_dirs, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dirs["gpt"], hf)
    # A stale sharded save beside the current model.safetensors: transformers reads the latter.
    stale = {k: v + 1 for k, v in load_file(str(hf / "model.safetensors")).items()}
    save_file(stale, str(hf / "model-00001-of-00001.safetensors"))
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in stale}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    _, state, _ = read_hf_dir(hf)
    _, fresh, _ = read_hf_dir(hf_dirs["gpt"])
    assert all(torch.equal(state[k], fresh[k]) for k in fresh)
    import_hf(hf_dirs["gpt"], tmp_path / "ckpt")
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(tmp_path / "ckpt", hf)
    export_hf(tmp_path / "ckpt", tmp_path / "empty")  # a new directory is fine


def test_a_large_conversion_says_it_started(hf_dirs, tmp_path, capsys, monkeypatch):
    """Converting gigabytes took a silent minute; past ``ANNOUNCE_BYTES`` of weights a line
    on stderr says what is being read (here the threshold is lowered to the test's files,
    whose size os.stat gives); stdout keeps the one summary line. The same for
    tools/checkpoint.py, from a training checkpoint root (its latest step's files)."""
    import engine.checkpoint.convert
    from engine.checkpoint import save_checkpoint
    from engine.models import build_model, preset

    main = _tool("convert_hf")
    size = Path(hf_dirs["gpt"], "model.safetensors").stat().st_size
    monkeypatch.setattr(engine.checkpoint.convert, "ANNOUNCE_BYTES", size)
    capsys.readouterr()
    assert main(["import", "--hf-dir", hf_dirs["gpt"], "--out", str(tmp_path / "ck")]) == 0
    out, err = capsys.readouterr()
    gib = size / (1 << 30)
    assert err == f"converting {gib:.1f} GiB of weights from {hf_dirs['gpt']} ...\n"
    assert out.startswith("imported gpt (GPT2LMHeadModel)") and out.count("\n") == 1
    monkeypatch.setattr(engine.checkpoint.convert, "ANNOUNCE_BYTES", size + 1)
    assert main(["export", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().err == ""  # smaller than the threshold: nothing said

    cfg = preset("gpt_tiny", vocab_size=100, hidden_size=16, num_heads=2, num_layers=1)
    save_checkpoint(tmp_path / "run", 1, model=build_model(cfg), optimizer=None, ps=None, state={})
    step = sum(p.stat().st_size for p in (tmp_path / "run" / "step_00000001").glob("*.safetensors"))
    monkeypatch.setattr(engine.checkpoint.convert, "ANNOUNCE_BYTES", step)
    argv = ["export-model", str(tmp_path / "run"), "--out", str(tmp_path / "weights")]
    assert _tool("checkpoint")(argv) == 0
    assert (
        capsys.readouterr().err
        == f"converting {step / (1 << 30):.1f} GiB of weights from {tmp_path / 'run'} ...\n"
    )


def test_convert_hf_user_errors_are_one_line(hf_dirs, tmp_path, capsys):
    main = _tool("convert_hf")
    bad_type = tmp_path / "llama"
    bad_type.mkdir()
    (bad_type / "config.json").write_text(json.dumps({"model_type": "llama"}))
    mlm = tmp_path / "mlm"
    transformers.BertForMaskedLM(
        transformers.BertConfig(
            hidden_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=96,
            vocab_size=101,
            max_position_embeddings=16,
        )
    ).save_pretrained(mlm)
    root = tmp_path / "run"
    (root / "final").mkdir(parents=True)
    import_hf(hf_dirs["gpt"], tmp_path / "ckpt")
    capsys.readouterr()  # drop save_pretrained's progress bar
    cases = [
        (["import", "--hf-dir", str(tmp_path), "--out", str(tmp_path / "o1")], "no config.json"),
        (["import", "--hf-dir", str(bad_type), "--out", str(tmp_path / "o2")], "'llama'"),
        (["import", "--hf-dir", str(mlm), "--out", str(tmp_path / "o3")], "BertForPreTraining"),
        (["export", "--ckpt", str(root), "--out", str(tmp_path / "o4")], "not a model export"),
        (["export", "--ckpt", str(tmp_path / "ckpt"), "--out", hf_dirs["gpt"]], "not empty"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("convert_hf.py: error: ") and err.count("\n") == 1, err
        assert expected in err, err


def test_verify_rejects_bad_hf_layouts_before_launching(hf_dirs, capsys):
    main = _tool("verify_equivalence")
    for flags, expected in (
        # the directory's sizes keep their config names (no --heads with --hf-dir)
        (["--tp-size", "3"], "model.num_heads=4 is not divisible by --tp-size 3"),
        (["--dp-size", "3"], "batch 4 is not divisible by --dp-size 3"),
        (["--tp-size", "0"], "--tp-size 0 must be >= 1"),
        (["--steps", "0"], "--steps 0 must be >= 1"),
    ):
        assert main(["--hf-dir", hf_dirs["gpt"], *flags]) == 2, flags
        assert expected in capsys.readouterr().err, flags
    assert main(["--hf-dir", "/nonexistent", "--tp-size", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err


def _llama_style_tokenizer(path: Path) -> None:
    """A byte-level BPE whose specials are Llama 2's ``<s>``/``</s>`` beside the document end
    a tokenizer trained here has (the family prefers its own tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    tokenizer.save(str(path))


# What AutoTokenizer reads back from each family's export: (tokenizer, {role: token}).
EXPORT_ROLES = {
    "gpt": ("preprocess", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}),
    "bert": (
        "preprocess",
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "pad_token": "[PAD]"},
    ),
    "llama": ("preprocess", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}),
    "llama-own-tokens": ("llama-style", {"bos_token": "<s>", "eos_token": "</s>"}),
}


@pytest.mark.parametrize("case", EXPORT_ROLES)
def test_hf_export_tokenizer_names_the_family_special_tokens(case, tmp_path):
    """An HF export's tokenizer files name the special tokens of the model's family
    (``Family.special_tokens``), as transformers' AutoTokenizer reads them from the folder,
    and config.json carries their ids. A Llama export names bos and eos: the document end
    of a tokenizer trained here, or Llama's own ``<s>``/``</s>`` where the vocabulary has
    them."""
    from transformers import AutoTokenizer

    from engine.checkpoint.format import write_checkpoint
    from engine.data.preprocess import EOD_TOKEN, save_tokenizer, train_tokenizer
    from engine.models import build_model, preset

    kind, roles = EXPORT_ROLES[case]
    tokenizer_path = tmp_path / "tokenizer.json"
    if kind == "preprocess":
        save_tokenizer(
            train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300), tokenizer_path
        )
    else:
        _llama_style_tokenizer(tokenizer_path)
    arch = case.split("-")[0]
    cfg = preset(f"{arch}_tiny", vocab_size=300, hidden_size=32, num_heads=4, num_layers=2)
    torch.manual_seed(0)
    ckpt, hf_dir = tmp_path / "ckpt", tmp_path / "hf"
    write_checkpoint(ckpt, build_model(cfg).full_state_dict(), cfg, tokenizer=tokenizer_path)
    export_hf(ckpt, hf_dir)

    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = hf_tokenizer.get_vocab()
    config = json.loads((hf_dir / "config.json").read_text())
    for role, token in roles.items():
        assert getattr(hf_tokenizer, role) == token, role
        assert getattr(hf_tokenizer, f"{role}_id") == vocab[token], role
        assert config[f"{role}_id"] == vocab[token], role
    if arch == "bert":  # pairs framed as the pre-training samples are, with token types
        plain = hf_tokenizer("a + b", "return a", add_special_tokens=False).input_ids
        cls, sep = vocab["[CLS]"], vocab["[SEP]"]
        a, b = (hf_tokenizer(t, add_special_tokens=False).input_ids for t in ("a + b", "return a"))
        pair = hf_tokenizer("a + b", "return a")
        assert pair.input_ids == [cls, *a, sep, *b, sep] and plain == a + b
        assert pair.token_type_ids == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    if arch != "bert":  # a decoder's end of sequence is its document end
        assert hf_tokenizer.eos_token is not None
        assert hf_tokenizer.eos_token == roles["eos_token"]
        if kind == "preprocess":
            assert hf_tokenizer.eos_token == EOD_TOKEN


def _implicit_uses_reading(hf_dir: str) -> list[str]:
    import warnings

    ps = parallel_state.initialize(1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_hf_dir(hf_dir, tp_group=ps.tp_group)
    return [str(w.message) for w in caught if w.category is parallel_state.ImplicitStateWarning]


def test_reading_an_hf_dir_under_a_mesh_reaches_no_default_state(hf_dirs):
    """The verifier reads an HF directory on each rank with its TP group: the shape-only
    meta build inside draws nothing, so it must not warn that the default state's RNG was
    used (every --hf-dir run printed that warning)."""
    assert run_ranks(_implicit_uses_reading, 1, hf_dirs["gpt"]) == [[]]


def test_export_reads_a_training_checkpoint_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    """``convert_hf.py export --ckpt ROOT`` took model exports only (a run's root was refused
    with "pass ROOT/final"). Now a training checkpoint root exports its latest step: the
    folder transformers reads gives the logits of the model that was saved (float32, tol
    1e-5 on logits of order 1: summation order). An export that fails part way (here the
    tokenizer conversion) leaves no directory behind, where it left the weights alone."""
    import engine.hf_interop
    from engine.checkpoint import save_checkpoint
    from engine.data.preprocess import save_tokenizer, train_tokenizer
    from engine.models import build_model, preset
    from engine.optim import OptimConfig, build_optimizer

    tokenizer = tmp_path / "tokenizer.json"
    save_tokenizer(train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300), tokenizer)
    cfg = preset("gpt_tiny", vocab_size=300, hidden_size=32, num_heads=4, num_layers=2)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    record = {"tokenizer": {"path": str(tokenizer), "sha256": _sha256(tokenizer)}}
    save_checkpoint(tmp_path / "run", 1, model=model, optimizer=optimizer, ps=None, state=record)

    main = _tool("convert_hf")
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        ours = ours if ours.shape[:2] == ids.shape else ours.transpose(0, 1)
        ours = ours[..., :300]  # the padded vocabulary's extra columns dropped
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-5
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()

    def fail(*args, **kwargs):
        raise ValueError("tokenizer conversion failed")

    monkeypatch.setattr(engine.hf_interop, "write_hf_tokenizer", fail)
    with pytest.raises(ValueError, match="tokenizer conversion failed"):
        export_hf(tmp_path / "run", tmp_path / "hf2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run", "tokenizer.json"]


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
