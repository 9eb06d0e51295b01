"""lm-eval (EleutherAI's harness) as a client of apps.serve, with the README's command.

The tiny random GPT of tests/test_serve.py is exported with Hugging Face tokenizer files
(lm-eval's ``local-completions`` tokenizes with ``AutoTokenizer`` and sends token ids) and
served in this process on a free port; ``lm_eval`` runs as a command, offline, on the two
local tasks of ``apps/eval_tasks``. The references never touch the server: the
log-likelihoods are minus the summed per-token training losses of one plain forward of the
model before export (``studies/eval/lm_eval_check.py``, the same comparison the README runs
on the quick start's model), the generations ``engine.generate.generate_batch``'s greedy
tokens cut at the task's stop string.

Tolerance: ``lm_eval_check.within``, test_serve's per-token float32 bound
``1e-5 + 1e-5·|logprob|`` summed over the continuation's tokens (the server's log-softmax
and the fused cross-entropy differ in summation order only). Generated text exactly: with
init_std 0.2 the top-1 token leads by far more than that rounding (tests/test_serve.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.tokenizer import write_hf_tokenizer
from engine.generate import Sampling, generate_batch
from studies.eval.lm_eval_check import read_samples, reference_loglikelihoods, within
from tests.multiproc import subprocess_env
from tests.test_serve import _serving, make_export
from tests.threads_util import torch_threads

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extras: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "apps" / "eval_tasks"


def _lm_eval(url: str, tokenizer: Path, out: Path, home: Path) -> str:
    """Run the README's ``lm_eval`` command against ``url``; its stdout (the table)."""
    args = f"base_url={url}/completions,model=tiny,tokenizer={tokenizer},"
    args += "tokenizer_backend=huggingface,max_length=128"
    command = [
        *(sys.executable, "-m", "lm_eval", "--model", "local-completions"),
        *("--model_args", args, "--tasks", "meshtron_ll,meshtron_gen"),
        *("--include_path", "apps/eval_tasks", "--log_samples", "--output_path", str(out)),
    ]
    # Offline, and the datasets cache in the test's own folder, not the user's.
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(home)}
    env = subprocess_env(ROOT) | offline | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _generations(out: Path) -> list[tuple[str, str]]:
    """``(prompt, generated text)`` of every meshtron_gen sample lm-eval logged."""
    (path,) = out.glob("**/samples_meshtron_gen_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["doc"]["prompt"], r["filtered_resps"][0]) for r in rows]


@pytest.mark.slow
def test_lm_eval_loglikelihoods_equal_the_training_loss_and_generations_greedy(tmp_path):
    directory, tokenizer, model = make_export(tmp_path / "tiny")
    hf_tokenizer = tmp_path / "hf-tokenizer"  # what AutoTokenizer.from_pretrained opens
    hf_tokenizer.mkdir()
    write_hf_tokenizer(directory / "tokenizer.json", hf_tokenizer, arch="gpt", max_positions=128)
    with torch_threads(1), _serving(directory, "--max-running", "4") as (client, _):
        url = str(client.base_url).rstrip("/")
        table = _lm_eval(url, hf_tokenizer, tmp_path / "out", tmp_path)
    assert "meshtron_ll" in table and "meshtron_gen" in table, table
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    rows = read_samples(str(tmp_path / "out"), "meshtron_ll")
    expected = [json.loads(line) for line in (TASKS / "meshtron_ll.jsonl").read_text().splitlines()]
    assert [(c, t) for c, t, _ in rows] == [(e["context"], e["continuation"]) for e in expected]
    reference = reference_loglikelihoods(model, encode, [(c, t) for c, t, _ in rows])
    for (_, _, got), (want, tokens) in zip(rows, reference, strict=True):
        assert tokens > 0 and within(got, want, tokens), (got, want, tokens)
    for prompt, text in _generations(tmp_path / "out"):
        ids = generate_batch(model, [encode(prompt)], 8, Sampling(greedy=True))[0]
        assert text == tokenizer.decode(ids).split("\n")[0], prompt
