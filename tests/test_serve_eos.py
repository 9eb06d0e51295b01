"""Where a sample ends, and which chat template is read: for models whose tokenizer has no
Hugging Face ``tokenizer_config.json`` beside it, one saved as ``chat_template.jinja``, and
an imported model's own tokenizer files.

A model trained here ends every document with the document-end token, but its export and
its training checkpoint carry ``tokenizer.json`` alone: the server never stopped there (no
eos known) and ``tools/generate.py`` had no end of sequence at all. Now both take the
family's end of sequence (the token the Hugging Face export names ``eos_token``).

The model is a tiny random GPT whose word embedding has two rows swapped: the document end
and the token its greedy continuation emits at step k. With tied embeddings that is the same
model under renamed ids, so its greedy continuation is the unswapped one's with the two ids
exchanged (checked), and the reference for "stops at the document end" is that
continuation cut before step k, by hand. Token ids compare exactly (init_std 0.2: the top
logit leads by far more than float32 rounding, as tests/test_serve.py says).
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.format import write_checkpoint
from engine.data.preprocess import EOD_TOKEN, save_tokenizer, train_tokenizer
from engine.generate import Sampling, generate_batch
from engine.models import build_model
from tests.test_serve import _serving
from tests.threads_util import torch_threads
from tests.tiny_configs import HF_GQA_UNTIED, hf_tiny
from tests.torch_reference import tiny_gpt

PROMPT = "def add(a, b):"
NEW = 16  # tokens asked for


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """(export dir, tokenizer, the continuation cut before the document end, k)."""
    root = tmp_path_factory.mktemp("eos")
    text = "def add(a, b):\n    return a + b\nclass Point:\n    x = 1\nimport os\n"
    tokenizer = train_tokenizer([text] * 20, 300)
    eod = tokenizer.token_to_id(EOD_TOKEN)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    cfg = tiny_gpt(tokenizer.get_vocab_size(), max_positions=128, init_std=0.2)
    torch.manual_seed(3)
    with torch_threads(1):
        model = build_model(cfg).eval()
        greedy = generate_batch(model, [prompt], NEW, Sampling(greedy=True))[0]
        k = next(
            k
            for k in range(2, NEW - 2)
            if greedy[k] not in {eod, *prompt, *greedy[:k]} and eod not in greedy[: k + 1]
        )
        with torch.no_grad():  # the document end and greedy[k] trade places
            word = model.embedding.word.weight
            word[[eod, greedy[k]]] = word[[greedy[k], eod]].clone()
        renamed = {eod: greedy[k], greedy[k]: eod}
        again = generate_batch(model, [prompt], NEW, Sampling(greedy=True))[0]
        assert again == [renamed.get(t, t) for t in greedy]  # the same model, ids renamed
    directory = root / "export"
    save_tokenizer(tokenizer, root / "tokenizer.json")
    write_checkpoint(directory, model.full_state_dict(), cfg, tokenizer=root / "tokenizer.json")
    assert not (directory / "tokenizer_config.json").exists()  # what this file is about
    return directory, tokenizer, again, k


def test_server_and_generate_end_a_sample_at_the_document_end(swapped, capsys):
    from apps.generate_text import main as generate_main

    directory, tokenizer, continuation, k = swapped
    expected = tokenizer.decode(continuation[:k])
    with _serving(directory) as (client, _):
        done = client.completions.create(
            model="export", prompt=PROMPT, max_tokens=NEW, temperature=0
        ).choices[0]
        assert (done.text, done.finish_reason) == (expected, "stop")
        on = client.completions.create(
            model="export",
            prompt=PROMPT,
            max_tokens=NEW,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == NEW
        assert on.choices[0].text == tokenizer.decode(continuation)  # the end token: no text
    argv = ["--ckpt", str(directory), "--prompt", PROMPT, "--greedy", "--max-new-tokens", str(NEW)]
    assert generate_main(argv) == 0
    assert capsys.readouterr().out == f"--- sample 1 ---\n{PROMPT}{expected}\n"
    assert generate_main([*argv, "--ignore-eos"]) == 0
    printed = capsys.readouterr().out
    assert printed == f"--- sample 1 ---\n{PROMPT}{tokenizer.decode(continuation)}\n"


def test_a_chat_template_saved_as_chat_template_jinja_is_used(swapped, tmp_path):
    """transformers now saves a tokenizer's chat template as ``chat_template.jinja`` beside
    ``tokenizer_config.json`` (which then has none); the server said "no chat template".
    The reference: transformers' own ``apply_chat_template`` of the same messages."""
    transformers = pytest.importorskip("transformers")
    directory, tokenizer, _, _ = swapped
    folder = tmp_path / "with-template"
    folder.mkdir()
    for name in ("meshtron.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_bytes((directory / name).read_bytes())
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token=EOD_TOKEN
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(str(folder))
    assert (folder / "chat_template.jinja").is_file()
    assert "chat_template" not in (folder / "tokenizer_config.json").read_text()
    messages = [{"role": "user", "content": "def add"}]
    ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]  # a BatchEncoding in newer ones
    with _serving(folder) as (client, _):
        answer = client.chat.completions.create(
            model="with-template", messages=messages, max_tokens=2, temperature=0
        )
    assert answer.usage.prompt_tokens == len(ids)


def test_an_import_keeps_the_tokenizer_files_that_say_how_it_is_used(tmp_path):
    """An imported model kept tokenizer.json alone: served from its meshtron checkpoint it
    had no chat template and took the family's eos, ``<|endoftext|>``, where the model's is
    ``<|im_end|>``; its export wrote a tokenizer_config of its own. Now the import keeps
    ``tokenizer_config.json``, ``special_tokens_map.json`` and ``chat_template.jinja``
    beside the tokenizer, the server reads them, and the export gives them back byte for
    byte. References: transformers' apply_chat_template and its eos_token_id."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from apps.serving.text import TextCodec
    from engine.hf_interop import export_hf, import_hf

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    base.train_from_iterator(["hello world, def f(x): return x\n"] * 30, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=64, **HF_GQA_UNTIED)
    config = transformers.Qwen2Config(**hf_tiny(**sizes, eos_token_id=fast.eos_token_id))
    torch.manual_seed(0)
    hf_dir = tmp_path / "qwen2"
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(hf_dir))
    fast.save_pretrained(str(hf_dir))
    names = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    sides = [n for n in names if (hf_dir / n).is_file()]  # the map: older transformers only
    assert {"tokenizer_config.json", "chat_template.jinja"} <= set(sides)

    import_hf(hf_dir, tmp_path / "ckpt")
    codec = TextCodec.from_files(str(tmp_path / "ckpt" / "tokenizer.json"), arch="llama")
    assert codec.eos_ids == {fast.eos_token_id}
    messages = [{"role": "user", "content": "hello"}]
    ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    with _serving(tmp_path / "ckpt") as (client, _):
        answer = client.chat.completions.create(
            model="ckpt", messages=messages, max_tokens=2, temperature=0
        )
    assert answer.usage.prompt_tokens == len(ids)
    export_hf(tmp_path / "ckpt", tmp_path / "again")
    for name in sides:
        assert (tmp_path / "again" / name).read_bytes() == (hf_dir / name).read_bytes(), name
