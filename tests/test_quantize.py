"""Int8 weight-only quantization (layers/quantize.py, engine/models/quantize.py, --quantize).

References, each written out here and not taken from the code under test:

* a weight's quantization by hand, row by row: scale = max|row| / 127, q = round(w / scale);
  the layer's output must equal ``F.linear(x, q · scale, b)`` to float32 rounding
  (atol = rtol = 1e-5: products of order 1 summed over 32 to 128 terms, and the layer
  applies the scale to the output, the reference to the weight, a few ulp apart), and the
  dequantized weight must lie within scale / 2 of the float weight (the rounding bound;
  1e-7 added for the float32 division);
* the whole int8 model (GPT tied, Llama untied with grouped-query attention) against the
  float32 model loaded with every quantized weight replaced by its hand-dequantized value
  (atol = rtol = 1e-4: float32 rounding through two layers, logits of order 10);
* at TP 2 (two real gloo ranks): column-parallel shards hold whole rows, so their outputs
  gathered equal the TP 1 int8 layer's to float32 rounding (1e-5). A row-parallel shard
  takes its own per-row scale over its half of the columns, so TP 2 is a different (finer)
  quantization: its output must equal the hand reference built from per-shard scales to
  float32 rounding, and differ from the TP 1 int8 output by no more than the two rounding
  bounds added, Σ_i |x_i| · (s1_j + s2_j,shard(i)) / 2 (+ 1e-5);
* the server built by ``apps.serve``'s own ``build`` with ``--quantize int8``, over a tiny
  random GPT export: a greedy request answers exactly what ``generate_batch`` gives on the
  same model quantized in-process, and the perplexity it reports for a small text (echo,
  max_tokens 0) is within 2 % of the float32 server's (measured: 0.5 %).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from engine.generate import Sampling, generate_batch
from engine.models import build_model
from engine.models.quantize import quantize_model_, weight_memory
from layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from layers.quantize import (
    Int8ColumnParallelLinear,
    Int8RowParallelLinear,
    Int8VocabParallelEmbedding,
)
from tests.multiproc import run_ranks
from tests.tiny_configs import serving_config
from tests.torch_reference import tiny_gpt

TOL = dict(atol=1e-5, rtol=1e-5)  # float32 rounding (docstring)
IN, OUT = 48, 40


def _by_hand(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as float, scale) row by row, in plain Python arithmetic on each row's maximum."""
    q, scales = torch.empty_like(w), torch.empty(w.shape[0])
    for j, row in enumerate(w):
        top = max(abs(float(v)) for v in row)
        scale = top / 127 if top > 0 else 1.0
        q[j] = torch.round(row / scale)
        scales[j] = scale
    assert q.abs().max() <= 127
    return q, scales


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(OUT, IN, generator=g) * torch.linspace(0.01, 2.0, OUT).unsqueeze(1)
    w[3] = 0  # an all-zero row (vocabulary padding has them)
    return w, torch.randn(OUT, generator=g), torch.randn(5, 2, IN, generator=g)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_int8_linear_equals_the_hand_dequantized_reference(kind):
    w, b, x = _weights(0)
    if kind == "column":
        layer = Int8ColumnParallelLinear(ColumnParallelLinear.from_full(w, b))
    else:
        layer = Int8RowParallelLinear(RowParallelLinear.from_full(w, b))
    q, scale = _by_hand(w)
    assert torch.equal(layer.int8.qweight.float(), q) and layer.int8.qweight.dtype == torch.int8
    torch.testing.assert_close(layer.int8.scale, scale, **TOL)
    dequantized = q * scale.unsqueeze(1)
    torch.testing.assert_close(layer(x), F.linear(x, dequantized, b), **TOL)
    error = (dequantized - w).abs().amax(dim=1)  # per output channel
    assert (error <= scale / 2 + 1e-7).all(), (error / scale).max()
    assert error[3] == 0


def test_int8_embedding_rows_are_the_hand_dequantized_rows():
    w, _, _ = _weights(1)
    table = Int8VocabParallelEmbedding(VocabParallelEmbedding.from_full(w))
    q, scale = _by_hand(w)
    ids = torch.tensor([[0, 3, 39], [7, 7, 12]])
    torch.testing.assert_close(table(ids), (q * scale.unsqueeze(1))[ids], **TOL)


def _tp2_linears(seed: int) -> dict[str, torch.Tensor]:
    import parallel_state

    ps = parallel_state.initialize(2)
    w, b, x = _weights(seed)
    tp = {"tp_group": ps.tp_group}
    column = ColumnParallelLinear.from_full(w, b, gather_output=True, **tp)
    row = RowParallelLinear.from_full(w, b, input_is_parallel=False, **tp)
    column, row = Int8ColumnParallelLinear(column), Int8RowParallelLinear(row)
    return {
        "rank": torch.tensor(ps.tp_rank),
        "column": column(x),
        "row": row(x),
        "row_scale": row.int8.scale,
    }


def test_tp2_shards_assembled_equal_tp1_quantized():
    w, b, x = _weights(2)
    ranks = run_ranks(_tp2_linears, 2, 2)
    tp1_column = Int8ColumnParallelLinear(ColumnParallelLinear.from_full(w, b))(x)
    tp1_row = Int8RowParallelLinear(RowParallelLinear.from_full(w, b))(x)
    halves = w.chunk(2, dim=1)  # the row-parallel shards' columns
    reference, bound = b.clone(), torch.zeros(OUT)
    _, s1 = _by_hand(w)
    for rank, half in enumerate(halves):
        q, s2 = _by_hand(half)
        torch.testing.assert_close(ranks[rank]["row_scale"], s2, **TOL)
        reference = reference + F.linear(x.chunk(2, dim=-1)[rank], q * s2.unsqueeze(1))
        bound = bound + (s1 + s2) / 2 * x.chunk(2, dim=-1)[rank].abs().sum(-1, keepdim=True)
    for rank in ranks:
        torch.testing.assert_close(rank["column"], tp1_column, **TOL)
        torch.testing.assert_close(rank["row"], reference, **TOL)
        assert ((rank["row"] - tp1_row).abs() <= bound + 1e-5).all()


def test_weight_memory_counts_a_tied_table_once():
    cfg = tiny_gpt(300, hidden_size=64, max_positions=32)
    model = build_model(cfg).eval()
    before = weight_memory(model)
    assert (
        before["total"]
        == before["float_equivalent"]
        == 2 * sum(p.numel() for p in model.parameters())
    )
    quantize_model_(model)
    assert quantize_model_(model) is model  # a second call changes nothing
    after = weight_memory(model)
    assert after["float_equivalent"] == before["total"]
    assert model.lm_head.int8 is model.embedding.word.int8  # tied: one int8 table
    int8_elements = sum(m.qweight.numel() for m in {model.lm_head.int8} | _layer_int8(model))
    assert after["int8"] == int8_elements + 4 * sum(
        m.scale.numel() for m in {model.lm_head.int8} | _layer_int8(model)
    )
    assert after["total"] < 0.6 * before["total"]


QUANTIZED = re.compile(
    r"(embedding\.word|lm_head|attention\.(qkv|query|key_value|dense)|mlp\.fc[12])\.weight$"
)


def _dequantized_by_hand(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every weight --quantize int8 stores replaced by q · scale (by hand)."""
    out = dict(state)
    for name, w in state.items():
        if QUANTIZED.search(name):
            q, scale = _by_hand(w)
            out[name] = q * scale.unsqueeze(1)
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_int8_model_is_the_float_model_with_hand_dequantized_weights(family):
    """The whole int8 model (tied GPT; Llama: untied head, grouped-query query/key_value,
    SwiGLU, rotary) gives the logits of the float32 model loaded with each quantized
    weight replaced by its hand-dequantized value (atol = rtol = 1e-4: float32 rounding
    through two layers on logits of order 10), keeps the KV cache float32, and generates
    the same greedy tokens with the cache as by re-encoding. The logits' drift from the
    unquantized model is printed (measured: up to 3 % of the largest logit, gpt and llama,
    random init_std 0.2 weights)."""
    from engine.inference import inference_config
    from layers.quantize import Int8VocabParallelHead

    cfg = inference_config(serving_config(family))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    state = model.full_state_dict()
    reference = build_model(cfg).eval()
    reference.load_full_state_dict(_dequantized_by_hand(state))
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 250, 1]])
    with torch.no_grad():
        unquantized, expected = model(ids), reference(ids)
    quantize_model_(model)
    assert isinstance(model.lm_head, Int8VocabParallelHead)
    assert (model.lm_head.int8 is model.embedding.word.int8) == (family == "gpt")  # tied
    assert not any(p.dtype == torch.int8 for p in model.parameters())  # int8 in buffers
    with torch.no_grad():
        got = model(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    drift = float((got - unquantized).abs().max() / unquantized.abs().max())
    print(f"{family} int8: max |Δ logit| / max |logit| against float32 = {drift:.2e}")
    assert model.new_cache(1, 8)[0].keys.dtype == torch.float32
    prompts = [[5, 17, 42], [250, 1, 2, 3, 4]]
    greedy = Sampling(greedy=True)
    cached = generate_batch(model, prompts, 10, greedy)
    assert cached == generate_batch(model, prompts, 10, greedy, use_cache=False)


def test_encoders_are_refused():
    from engine.models import preset

    model = build_model(preset("bert_tiny", vocab_size=300, hidden_size=32, num_heads=4))
    with pytest.raises(ValueError, match="for decoders"):
        quantize_model_(model)


def _layer_int8(model) -> set:
    from layers.quantize import Int8Weight

    return {m for m in model.layers.modules() if isinstance(m, Int8Weight)}


# --- the server -------------------------------------------------------------------------
# Its imports (openai, uvicorn, tests.test_serve) stay inside the tests, so the TP 2 ranks,
# which import this module to find their function, do not load them.

TEXT = "def add(a, b):\n    return a + b\nclass Point:\n    x = 1\nimport os\n"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(export directory, tokenizer, model): a tiny random GPT (init_std 0.2: logits of order
    1, as tests/test_serve.py's) with a byte-level BPE tokenizer trained on ``TEXT`` (with the
    end-of-text token engine.evaluate appends to a text file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.checkpoint.format import write_checkpoint

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"], initial_alphabet=alphabet
    )
    tokenizer.train_from_iterator([TEXT] * 20, trainer)
    cfg = tiny_gpt(tokenizer.get_vocab_size(), max_positions=128, init_std=0.2)
    torch.manual_seed(3)
    model = build_model(cfg).eval()
    directory = tmp_path_factory.mktemp("quantize") / "tiny"
    write_checkpoint(directory, model.full_state_dict(), cfg)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, tokenizer, model


def _perplexity(client, ids: list[int]) -> float:
    """exp(−mean log p) of ``ids`` 1.. given what precedes each, as the server scores them."""
    from tests.test_serve import _completion

    scored = _completion(client, ids, max_tokens=0, echo=True, logprobs=1).choices[0]
    logprobs = scored.logprobs.token_logprobs[1:]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_int8_server_answers_greedy_and_its_perplexity_is_near_float32(export):
    pytest.importorskip("openai")
    from tests.test_serve import _completion, _serving

    directory, tokenizer, model = export
    quantized = build_model(model.cfg).eval()
    quantized.load_full_state_dict(model.full_state_dict())
    quantize_model_(quantized)
    ids = tokenizer.encode(TEXT).ids
    prompt = tokenizer.encode("def add(a, b):").ids
    with _serving(directory, "--quantize", "int8") as (client, server):
        assert type(server.engine.model.lm_head).__name__ == "Int8VocabParallelHead"
        extra = {"ignore_eos": True}  # generate_batch does not stop at the end-of-text id
        answer = _completion(client, prompt, max_tokens=12, temperature=0, extra_body=extra)
        answer = answer.choices[0]
        expected = generate_batch(quantized, [prompt], 12, Sampling(greedy=True))[0]
        assert answer.text == tokenizer.decode(expected)
        int8 = _perplexity(client, ids)
    with _serving(directory) as (client, _):
        fp32 = _perplexity(client, ids)
    print(f"perplexity fp32 {fp32:.4f}, int8 {int8:.4f} ({int8 / fp32 - 1:+.3%})")
    assert abs(int8 / fp32 - 1) <= 0.02


def test_evaluate_int8_is_the_float_loss_of_the_hand_dequantized_weights(export, tmp_path, capsys):
    """``engine.evaluate --quantize int8`` (what tools/quantize_report.py runs) on the export
    gives the loss ``--quantize none`` gives on a copy whose quantized weights were replaced
    by their hand-dequantized values (rtol 1e-5: float32, the same windows)."""
    import json

    from engine.checkpoint.format import write_checkpoint
    from engine.evaluate import main

    directory, tokenizer, model = export
    copy = tmp_path / "dequantized"
    write_checkpoint(copy, _dequantized_by_hand(model.full_state_dict()), model.cfg)
    tokenizer.save(str(copy / "tokenizer.json"))
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT * 4)
    common = ["--text", str(text), "--seq-len", "16", "--micro-batch", "1", "--device", "cpu"]
    results = []
    for where, mode in ((directory, "int8"), (copy, "none"), (directory, "none")):
        assert main(["--ckpt", str(where), *common, "--quantize", mode]) == 0
        results.append(json.loads(capsys.readouterr().out))
    int8, by_hand, fp32 = results
    assert int8["quantize"] == "int8" and "quantize" not in fp32
    assert int8["sequences"] == fp32["sequences"] >= 3
    torch.testing.assert_close(int8["loss"], by_hand["loss"], rtol=1e-5, atol=0)
    print(f"loss fp32 {fp32['loss']:.5f}, int8 {int8['loss']:.5f}")


@pytest.mark.slow
def test_quantize_report_reads_paths_relative_to_where_it_is_run(export, tmp_path, capsys):
    """tools/quantize_report.py run from another directory with relative --ckpt and --text:
    before, its evaluation subprocess ran in the checkout and found neither ("... does not
    exist"). Its fp32 perplexity is exp of engine.evaluate's loss on the same file, run in
    this process with absolute paths on the same default device (rtol 1e-6: the same
    float32 loss, written out in full by both, then one exp)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from engine.evaluate import main

    shutil.copytree(export[0], tmp_path / "model")
    (tmp_path / "held_out.txt").write_text(TEXT * 40)  # a few windows of the 128 positions
    repo = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    argv = ["--ckpt", "model", "--text", "held_out.txt", "--max-new-tokens", "2"]
    done = subprocess.run(
        [sys.executable, str(repo / "tools" / "quantize_report.py"), *argv],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    text = str(tmp_path / "held_out.txt")
    assert main(["--ckpt", str(tmp_path / "model"), "--text", text]) == 0
    loss = json.loads(capsys.readouterr().out)["loss"]
    assert report["perplexity"]["fp32"] == pytest.approx(math.exp(loss), rel=1e-6)


def test_quantize_report_refuses_what_it_cannot_generate_before_evaluating(
    export, tmp_path, monkeypatch, capsys
):
    """A --max-new-tokens past the model's positions, or a model with no tokenizer: one
    line and exit 2 before either evaluation. Before, both evaluations ran and then greedy
    decoding slid its window for 100,000 tokens (minutes, no output); a model with no
    tokenizer was a TypeError after them. The room is counted here with the tokenizer
    itself: max_positions 128 less the prompt's tokens."""
    import importlib.util
    import shutil
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "quantize_report.py"
    spec = importlib.util.spec_from_file_location("quantize_report", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def evaluated(*args):
        raise AssertionError("an evaluation started")

    monkeypatch.setattr(tool, "_evaluate", evaluated)
    directory, tokenizer, _ = export
    n = len(tokenizer.encode("def ").ids)
    assert tool.main(["--ckpt", str(directory), "--max-new-tokens", "1000"]) == 2
    assert capsys.readouterr().err == (
        f"quantize_report: --max-new-tokens 1000 after a prompt of {n} tokens needs "
        f"{n + 1000} positions, the model has 128: pass --max-new-tokens {128 - n} or less\n"
    )
    shutil.copytree(directory, tmp_path / "bare")
    (tmp_path / "bare" / "tokenizer.json").unlink()
    assert tool.main(["--ckpt", str(tmp_path / "bare")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantize_report: ") and err.count("\n") == 1, err
    assert "bare records no tokenizer.json (the greedy comparison needs one)" in err, err
