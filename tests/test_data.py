"""Data pipeline tests: preprocessing, index format, GPT/BERT samples, blending, DP loading.

References are built independently in each test (plain numpy concatenation of the documents,
direct reads of the source files); statistical checks use binomial bounds stated inline.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from engine.data import default_corpus
from engine.data import preprocess as preprocess_module
from engine.data.bert_dataset import IGNORE_INDEX, BertDataset
from engine.data.blend import BlendedDataset, blend_assignment, split_documents
from engine.data.gpt_dataset import GPTDataset
from engine.data.indexed import IndexedDataset, IndexedDatasetWriter
from engine.data.loader import DataIterator
from engine.data.preprocess import SPECIAL_TOKENS, iter_documents, preprocess
from tests.multiproc import subprocess_env

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "preprocess_data.py"

TEXTS = [
    "Hello, world!\n",
    "tabs\there\t\tand  double  spaces\n\n\nblank lines above\n",
    "unicode: héllo wörld — ñ 日本語 🙂 e\u0301 (combining)\r\nwindows line end\r\n",
    "  leading spaces and a literal <|endoftext|> that is text, not a boundary",
    "",
    "def f(x):\n    return x ** 2  # trailing spaces   \n",
]
EOD, PAD, CLS, SEP, MASK = range(len(SPECIAL_TOKENS))  # trained tokenizers put them first


def _write_texts(directory: Path, texts: list[str]) -> list[str]:
    paths = []
    for i, text in enumerate(texts):
        path = directory / f"doc{i:02d}.txt"
        path.write_bytes(text.encode("utf-8"))
        paths.append(str(path))
    return paths


def _decode_docs(prefix: str, tokenizer_path: str) -> list[str]:
    """Per-document text, checking the EOD layout on the way (EOD last and only there)."""
    indexed = IndexedDataset(prefix)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    eod = tokenizer.token_to_id("<|endoftext|>")
    assert indexed.eod_id == eod
    texts = []
    for i in range(len(indexed)):
        doc = indexed.doc(i)
        assert doc[-1] == eod and eod not in doc[:-1]
        texts.append(tokenizer.decode(doc[:-1].tolist(), skip_special_tokens=False))
    return texts


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """TEXTS preprocessed with a freshly trained 300-id BPE: (prefix, tokenizer path)."""
    directory = tmp_path_factory.mktemp("trained")
    paths = _write_texts(directory, TEXTS)
    result = preprocess(paths, str(directory / "out"), vocab_size=300, progress=False)
    return result.prefix, result.tokenizer_path


def _synthetic_indexed(path: Path, num_docs: int, *, seed: int = 0, vocab: int = 1000):
    """Random documents (ids outside the special range) written with EOD=0: (dataset, docs)."""
    rng = np.random.default_rng(seed)
    docs = [
        rng.integers(len(SPECIAL_TOKENS), vocab, size=rng.integers(0, 60)) for _ in range(num_docs)
    ]
    with IndexedDatasetWriter(path / "syn", vocab_size=vocab, eod_id=EOD) as writer:
        for doc in docs:
            writer.add_document(doc)
    return IndexedDataset(path / "syn"), docs


def _stream(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.append(doc, EOD) for doc in docs]).astype(np.int64)


# ---------------------------------------------------------------- preprocessing and index


def test_round_trip_is_exact_and_uint16(trained: tuple[str, str]) -> None:
    prefix, tokenizer_path = trained
    assert _decode_docs(prefix, tokenizer_path) == TEXTS
    indexed = IndexedDataset(prefix)
    assert indexed.dtype == np.uint16
    assert len(indexed) == len(TEXTS)
    assert Path(prefix + ".bin").stat().st_size == 2 * indexed.num_tokens
    tokenizer = Tokenizer.from_file(tokenizer_path)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [EOD, PAD, CLS, SEP, MASK]


def test_parallel_workers_match_serial(tmp_path: Path, trained: tuple[str, str]) -> None:
    _, tokenizer_path = trained
    paths = _write_texts(tmp_path, TEXTS * 200)  # > one 256-document chunk per worker
    for workers in (1, 2):
        preprocess(
            paths,
            str(tmp_path / f"w{workers}"),
            tokenizer_path=tokenizer_path,
            workers=workers,
            progress=False,
        )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()


def test_a_long_document_is_encoded_in_pieces_to_the_same_ids(
    trained: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document past ``_LONG_DOC_CHARS`` (made 40 here) is encoded in pieces cut before a
    whitespace run, which a byte-level pre-tokenizer never joins to the word before: the
    ids are the tokenizer's own for the whole text (spaces runs, newlines and tabs at the
    cuts included). A tokenizer with a normalizer is never cut."""
    from tokenizers import normalizers

    from engine.data import preprocess as pp

    _, tokenizer_path = trained
    tokenizer = pp._encoding_copy(Path(tokenizer_path).read_text())
    text = " ".join(TEXTS) + "  tail\n\n\tend   " + "x" * 100 + " last"
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(pp, "_LONG_DOC_CHARS", 40)
    assert len(pp._pieces(text)) > 5 and "".join(pp._pieces(text)) == text
    got = pp._encode_texts(tokenizer, [text, "short"])
    assert got[0].tolist() == whole
    assert got[1].tolist() == tokenizer.encode("short", add_special_tokens=False).ids
    assert pp._splits_safely(tokenizer)
    tokenizer.normalizer = normalizers.Prepend("▁")
    assert not pp._splits_safely(tokenizer)


def test_jsonl_json_key(tmp_path: Path, trained: tuple[str, str]) -> None:
    _, tokenizer_path = trained
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:3]) + "\n\n")  # blank line: skipped
    (tmp_path / "b.jsonl").write_text("\n".join(lines[3:]) + "\n")
    result = preprocess(
        [str(tmp_path / "*.jsonl")],
        str(tmp_path / "j"),
        json_key="text",
        tokenizer_path=tokenizer_path,
        progress=False,
    )
    assert _decode_docs(result.prefix, tokenizer_path) == TEXTS


def test_preprocess_errors(tmp_path: Path) -> None:
    text = _write_texts(tmp_path, ["some text"])
    with pytest.raises(ValueError, match="vocab size 100 too small.*261"):
        preprocess(text, str(tmp_path / "o"), vocab_size=100, progress=False)
    (tmp_path / "empty").mkdir()
    empty = _write_texts(tmp_path / "empty", [""])  # a lone empty document
    with pytest.raises(ValueError, match="empty corpus"):
        preprocess(empty, str(tmp_path / "o"), vocab_size=300, progress=False)
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".o*"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(CLI), "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")


def test_cli_success_and_errors(tmp_path: Path) -> None:
    _write_texts(tmp_path, TEXTS)
    prefix = str(tmp_path / "cli")
    done = _cli(
        "--input",
        str(tmp_path / "doc0*.txt"),
        "--output-prefix",
        prefix,
        "--vocab-size",
        "300",
        "--workers",
        "2",
    )
    assert done.returncode == 0, done.stderr
    assert _decode_docs(prefix, prefix + ".tokenizer.json") == TEXTS

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    done = _cli(
        "--input",
        str(bad),
        "--json-key",
        "text",
        "--output-prefix",
        prefix + "2",
        "--tokenizer",
        prefix + ".tokenizer.json",
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: {bad}:2: JSON line has no key 'text'"
    ]
    done = _cli(
        "--input",
        str(tmp_path / "missing.txt"),
        "--output-prefix",
        prefix + "3",
        "--vocab-size",
        "300",
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip() == f"preprocess_data.py: error: input not found: {tmp_path}/missing.txt"
    )
    assert not list(tmp_path.glob("cli2*")) and not list(tmp_path.glob("cli3*"))


@pytest.mark.parametrize(
    ("value", "kind"), [(123, "int"), (None, "null"), (["a"], "list"), ({"a": "b"}, "dict")]
)
def test_jsonl_non_string_value_is_rejected(tmp_path: Path, value, kind: str) -> None:
    path = tmp_path / "v.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(ValueError) as err:
        list(iter_documents([path], json_key="text"))
    assert str(err.value) == f"{path}:2: value of 'text' is {kind}, expected a string"


def test_output_prefix_in_missing_directory_is_created(tmp_path: Path) -> None:
    paths = _write_texts(tmp_path, TEXTS[:2])
    prefix = tmp_path / "nodir" / "sub" / "u1"
    result = preprocess(paths, str(prefix), vocab_size=300, progress=False)
    assert _decode_docs(result.prefix, result.tokenizer_path) == TEXTS[:2]
    assert result.tokenizer_path == f"{prefix}.tokenizer.json"


def _load_cli():
    spec = importlib.util.spec_from_file_location("preprocess_data_cli", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("where", ["encode", "train"])
def test_cli_interrupt_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch, capsys, where: str
) -> None:
    paths = _write_texts(tmp_path, TEXTS[:2])
    before = sorted(tmp_path.iterdir())

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    target = "encode_to_indexed" if where == "encode" else "train_tokenizer"
    monkeypatch.setattr(preprocess_module, target, interrupt)
    cli = _load_cli()
    argv = ["--no-progress", "--input", paths[0], "--input", paths[1]]
    argv += ["--output-prefix", str(tmp_path / "out"), "--vocab-size", "300"]
    try:
        status = cli.main(argv)
    except KeyboardInterrupt:  # escaping would abort the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main()")
    assert status == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["preprocess_data.py: interrupted; nothing was written"]
    assert sorted(tmp_path.iterdir()) == before  # no orphan PREFIX.tokenizer.json either


def test_cli_directory_input_and_corrupt_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    text = _write_texts(tmp_path, ["some text"])[0]
    adir = tmp_path / "adir"
    done = _cli("--input", str(adir), "--output-prefix", str(tmp_path / "o"), "--vocab-size", "300")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: {adir} is a directory without Parquet files "
        f"(pass files or a glob such as '{adir}/*.txt')"
    ]
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0" "model": }')
    done = _cli("--input", text, "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(bad))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"preprocess_data.py: error: {bad}: not a tokenizer.json ("
    ), done.stderr
    assert not list(tmp_path.glob("o*"))


def test_truncated_bin_and_bad_magic_are_rejected(tmp_path: Path) -> None:
    indexed, _ = _synthetic_indexed(tmp_path, 5)
    bin_path = Path(indexed.bin_path)
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"syn\.bin.*truncated"):
        IndexedDataset(tmp_path / "syn")
    idx_path = Path(indexed.idx_path)
    idx_path.write_bytes(b"NOTMAGIC" + idx_path.read_bytes()[8:])
    with pytest.raises(ValueError, match=r"syn\.idx.*magic"):
        IndexedDataset(tmp_path / "syn")


def test_writer_uint32_and_atomicity(tmp_path: Path) -> None:
    ids = np.array([1, 65535, 65536, 69999])
    with IndexedDatasetWriter(tmp_path / "big", vocab_size=70000, eod_id=0) as writer:
        writer.add_document(ids)
    big = IndexedDataset(tmp_path / "big")
    assert big.dtype == np.uint32
    np.testing.assert_array_equal(big.doc(0), np.append(ids, 0))

    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with (
        pytest.raises(RuntimeError),
        IndexedDatasetWriter(tmp_path / "big", vocab_size=9, eod_id=0) as w,
    ):
        w.add_document([1, 2, 3])
        raise RuntimeError("killed mid-write")
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before  # old pair intact, no temp files left


# ---------------------------------------------------------------- GPT


def test_gpt_windows_are_contiguous_stream_slices(tmp_path: Path) -> None:
    indexed, docs = _synthetic_indexed(tmp_path, 120)
    seq_len = 16
    for doc_range in [None, (10, 70)]:
        start, end = doc_range or (0, len(docs))
        stream = _stream(docs[start:end])
        reference = [
            stream[w * seq_len : w * seq_len + seq_len + 1]
            for w in range((len(stream) - 1) // seq_len)
        ]
        ds = GPTDataset(indexed, seq_len, seed=7, doc_range=doc_range)
        assert len(ds) == len(reference)
        samples = [ds[i] for i in range(len(ds))]
        assert all(s.dtype == torch.long and s.shape == (seq_len + 1,) for s in samples)
        # One epoch serves every reference window exactly once (multiset equality)...
        assert sorted(tuple(s.tolist()) for s in samples) == sorted(
            tuple(r.tolist()) for r in reference
        )
        # ...in the order the dataset reports.
        order = ds.sample_order(0)
        for i in (0, 1, len(ds) - 1):
            np.testing.assert_array_equal(samples[i].numpy(), reference[order[i]])


def test_gpt_shuffle_determinism_and_epochs(tmp_path: Path) -> None:
    indexed, _ = _synthetic_indexed(tmp_path, 120)
    ds, same, other = (GPTDataset(indexed, 16, seed=s) for s in (1, 1, 2))
    n = len(ds)
    order0, order1 = ds.sample_order(0).copy(), ds.sample_order(1).copy()
    for order in (order0, order1):
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    np.testing.assert_array_equal(order0, same.sample_order(0))
    assert not np.array_equal(order0, other.sample_order(0))
    assert not np.array_equal(order0, order1)
    # Index n + i is epoch 1's i-th window.
    for i in (0, 5, n - 1):
        torch.testing.assert_close(ds[n + i], ds[int(np.flatnonzero(order0 == order1[i])[0])])
    with pytest.raises(ValueError, match="fewer than seq_len"):
        GPTDataset(indexed, 10**6, seed=0)


# ---------------------------------------------------------------- loader


class _IndexEcho(torch.utils.data.Dataset):
    """Sample i is ``[i, i]``, so batches reveal which global indices they hold."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i])


def _step_indices(batches: list[torch.Tensor]) -> list[int]:
    return torch.cat([b[:, 0] for b in batches]).tolist()


def test_loader_dp_partition_and_resume() -> None:
    kwargs = dict(global_batch=24, micro_batch=3, dp_size=4)
    ranks = [DataIterator(_IndexEcho(), dp_rank=r, **kwargs) for r in range(4)]
    tp_twin = DataIterator(_IndexEcho(), dp_rank=2, **kwargs)  # another TP rank of DP group 2
    history: list[list[list[int]]] = []
    for step in range(4):
        consumed = step * 24
        assert all(it.consumed_samples == consumed for it in ranks)
        per_rank = []
        for it in ranks:
            batches = it.next_step()
            assert len(batches) == 24 // (3 * 4) and all(b.shape == (3, 2) for b in batches)
            per_rank.append(_step_indices(batches))
        assert sorted(sum(per_rank, [])) == list(
            range(consumed, consumed + 24)
        )  # disjoint, complete
        for r, got in enumerate(per_rank):
            assert got == list(range(consumed + 6 * r, consumed + 6 * r + 6))  # contiguous part
        assert _step_indices(tp_twin.next_step()) == per_rank[2]
        history.append(per_rank)
    resumed = DataIterator(_IndexEcho(), dp_rank=1, consumed_samples=2 * 24, **kwargs)
    assert [_step_indices(resumed.next_step()) for _ in range(2)] == [h[1] for h in history[2:]]
    assert resumed.state_dict() == {"consumed_samples": 4 * 24}


def test_loader_validates_divisibility() -> None:
    with pytest.raises(ValueError, match="global_batch 10 .* micro_batch 4 x dp_size 2 = 8"):
        DataIterator(_IndexEcho(), global_batch=10, micro_batch=4, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank 2"):
        DataIterator(_IndexEcho(), global_batch=8, micro_batch=4, dp_rank=2, dp_size=2)


# ---------------------------------------------------------------- BERT

BERT_SEQ_LEN, BERT_VOCAB = 64, 1000


def _bert(indexed: IndexedDataset, seed: int) -> BertDataset:
    return BertDataset(
        indexed,
        BERT_SEQ_LEN,
        seed=seed,
        cls_id=CLS,
        sep_id=SEP,
        mask_id=MASK,
        pad_id=PAD,
        vocab_size=BERT_VOCAB,
    )


def _within_sigmas(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    """|count - n p| <= sigmas * sqrt(n p (1 - p)): a binomial draw fails this ~6e-5 at 4 sigma."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.fixture(scope="module")
def bert_samples(tmp_path_factory: pytest.TempPathFactory):
    """(indexed, dataset, token stream, 6000 samples of epoch 0) over 13000 synthetic documents.

    6000 samples resolve a 5% SOP imbalance (300) at 4 sigma (155); masking sees ~350k candidates.
    """
    indexed, docs = _synthetic_indexed(tmp_path_factory.mktemp("bert"), 13000, vocab=BERT_VOCAB)
    ds = _bert(indexed, seed=3)
    return indexed, ds, _stream(docs), [ds[i] for i in range(6000)]


def test_bert_structure_matches_stream(bert_samples) -> None:
    _, ds, stream, samples = bert_samples
    padded = 0
    for i, s in enumerate(samples):
        ids, types, attn, labels = (
            s[k].numpy() for k in ("input_ids", "token_type_ids", "attention_mask", "mlm_labels")
        )
        original = np.where(labels != IGNORE_INDEX, labels, ids)
        length = int(attn.sum())
        assert np.all(attn[:length] == 1) and np.all(attn[length:] == 0)
        seps = np.flatnonzero(original == SEP)
        assert original[0] == CLS and len(seps) == 2 and seps[1] == length - 1
        assert np.all(original[length:] == PAD)
        assert np.all(types[: seps[0] + 1] == 0) and np.all(types[seps[0] + 1 : length] == 1)
        assert np.all(types[length:] == 0)
        first, second = original[1 : seps[0]], original[seps[0] + 1 : length - 1]
        assert len(first) >= 1 and len(second) >= 1
        span = np.concatenate([second, first] if s["sop_label"] else [first, second])
        start = ds.shuffle(i)[1] * (BERT_SEQ_LEN - 3)
        np.testing.assert_array_equal(span, stream[start : start + len(span)])
        padded += length < BERT_SEQ_LEN
    # short_seq_prob = 0.1 of 6000 samples: expect 600 padded; 4 sigma is +-93.
    assert _within_sigmas(padded, len(samples), 0.1)


def test_bert_masking_statistics(bert_samples) -> None:
    _, ds, _, samples = bert_samples
    ids = torch.stack([s["input_ids"] for s in samples]).numpy()
    labels = torch.stack([s["mlm_labels"] for s in samples]).numpy()
    original = np.where(labels != IGNORE_INDEX, labels, ids)
    special = np.isin(original, [EOD, PAD, CLS, SEP, MASK])
    chosen = labels != IGNORE_INDEX
    assert not np.any(chosen & special) and np.array_equal(ids[special], original[special])
    candidates = int((~special).sum())
    assert _within_sigmas(int(chosen.sum()), candidates, 0.15)

    n = int(chosen.sum())
    masked = int((ids[chosen] == MASK).sum())
    kept = int((ids[chosen] == original[chosen]).sum())
    randomized = ids[chosen & (ids != MASK) & (ids != original)]
    assert _within_sigmas(masked, n, 0.8)
    # A random replacement equals the original with p = 1/995, so "kept" is 0.1 + 0.1/995.
    assert _within_sigmas(kept, n, 0.1 + 0.1 / len(ds.random_ids))
    assert _within_sigmas(len(randomized), n, 0.1 - 0.1 / len(ds.random_ids))
    assert randomized.min() >= len(SPECIAL_TOKENS) and randomized.max() < BERT_VOCAB

    sop = sum(int(s["sop_label"]) for s in samples)
    assert _within_sigmas(sop, len(samples), 0.5)


def test_bert_determinism_and_collate(bert_samples) -> None:
    indexed, ds, _, samples = bert_samples
    twin, other = _bert(indexed, seed=3), _bert(indexed, seed=4)
    for i in (0, 17, 5999):
        for key, value in samples[i].items():
            torch.testing.assert_close(ds[i][key], value)  # same index, same sample: exact
            torch.testing.assert_close(twin[i][key], value)
    assert any(not torch.equal(other[i]["input_ids"], samples[i]["input_ids"]) for i in range(5))
    # The same span in the next epoch is masked afresh.
    later = ds.shuffle.order(1).tolist().index(ds.shuffle(0)[1]) + len(ds)
    assert not torch.equal(ds[later]["mlm_labels"], samples[0]["mlm_labels"])

    it = DataIterator(ds, global_batch=8, micro_batch=2, dp_rank=1, dp_size=2)
    batches = it.next_step()
    assert len(batches) == 2 and batches[0]["input_ids"].shape == (2, BERT_SEQ_LEN)
    assert batches[0]["sop_label"].shape == (2,)
    torch.testing.assert_close(batches[1]["input_ids"][1], samples[7]["input_ids"])


# ---------------------------------------------------------------- blending and splits


def test_blend_tracks_weights_in_every_prefix() -> None:
    weights, size = [5.0, 3.0, 2.0], 40_000  # > two lazily computed blocks
    sources = [[(k, j) for j in range(size)] for k in range(3)]
    blend = BlendedDataset(sources, weights, size)
    drawn = [blend[i] for i in range(size)]
    which_eager, index_eager = blend_assignment(weights, size)
    assert [(int(k), int(j)) for k, j in zip(which_eager, index_eager, strict=True)] == drawn
    which = np.array([k for k, _ in drawn])
    counts = np.cumsum(np.eye(3, dtype=np.int64)[which], axis=0)  # counts[n-1, k] after n draws
    target = np.arange(1, size + 1)[:, None] * (np.array(weights) / sum(weights))
    # Largest-deficit greedy: never > 1 ahead of a share, never > (K - 1) = 2 behind it.
    assert np.all(counts - target < 1) and np.all(target - counts < 2)
    np.testing.assert_allclose(counts[-1] / size, [0.5, 0.3, 0.2], atol=2 / size)
    for k in range(3):  # each source is read in order from index 0, no skips or repeats
        assert [j for kk, j in drawn if kk == k] == list(range(counts[-1, k]))
    with pytest.raises(IndexError):
        blend[size]


@pytest.mark.parametrize("num_docs", [1, 7, 1000, 12345])
@pytest.mark.parametrize("split", ["949,50,1", "8/1/1", "1", [0.5, 0.5]])
def test_split_documents_covers_without_overlap(num_docs: int, split) -> None:
    ranges = split_documents(num_docs, split)
    assert list(ranges) == ["train", "valid", "test"]
    bounds = [b for r in ranges.values() for b in r]
    assert bounds[0] == 0 and bounds[-1] == num_docs and bounds == sorted(bounds)
    assert all(ranges[a][1] == ranges[b][0] for a, b in [("train", "valid"), ("valid", "test")])
    parts = (
        [float(p) for p in split.replace("/", ",").split(",")] if isinstance(split, str) else split
    )
    fractions = (np.array(parts + [0] * (3 - len(parts))) / sum(parts)).tolist()
    exact = np.cumsum(fractions) * num_docs
    # Each boundary is the exact cumulative share rounded: within half a document.
    assert np.all(np.abs(np.array(bounds[1::2]) - exact) <= 0.5 + 1e-9)
    assert split_documents(1000) == {"train": (0, 949), "valid": (949, 999), "test": (999, 1000)}


def test_split_documents_rejects_bad_weights() -> None:
    for bad in ["1,-1", "0,0,0", "a,b", "1,1,1,1"]:
        with pytest.raises(ValueError):
            split_documents(10, bad)


# ---------------------------------------------------------------- default corpus

TINY = dict(vocab_size=400, max_bytes=200_000, progress=False)


def test_default_corpus_builds_round_trips_and_caches(tmp_path: Path, monkeypatch) -> None:
    prefix, tokenizer_path = default_corpus.build_default_corpus(tmp_path, **TINY)
    root, files = default_corpus.stdlib_sources(200_000)
    assert 0 < sum(size for _, size in files) <= 200_000
    assert all(not ("test" in rel.split("/") or "idlelib" in rel) for rel, _ in files)
    texts = [(root / rel).read_text(encoding="utf-8") for rel, _ in files]
    assert _decode_docs(prefix, tokenizer_path) == texts

    def no_training(*args, **kwargs):
        raise AssertionError("cache hit must not retrain")

    monkeypatch.setattr(default_corpus, "train_tokenizer", no_training)
    assert default_corpus.build_default_corpus(tmp_path, **TINY) == (prefix, tokenizer_path)
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path))
    assert default_corpus.build_default_corpus(**TINY) == (prefix, tokenizer_path)


def test_default_corpus_samples_the_whole_stdlib_into_every_split() -> None:
    """The split cuts contiguous document ranges, so the corpus order decides what each
    split is. Drawn in path order (the old recipe) the 4 MB cap held the alphabetically
    first files and the validation documents were all ``encodings/`` codec tables (a
    validation loss 1.5 below the training loss). Expected of a draw unrelated to the path:
    about half the bytes from each half of the sorted file list (bounds 0.25-0.75, where
    the path-order draw gives under 0.1), and validation documents from many packages."""
    root, files = default_corpus.stdlib_sources(4_000_000)  # data.default_max_bytes
    every = sorted(rel for rel, _ in default_corpus.stdlib_sources(10**12)[1])
    later_half = set(every[len(every) // 2 :])
    chosen_bytes = sum(size for _, size in files)
    later = sum(size for rel, size in files if rel in later_half)
    assert 0.25 < later / chosen_bytes < 0.75, (later, chosen_bytes)
    start, end = split_documents(len(files), "949,50,1")["valid"]
    valid_packages = {rel.split("/")[0] for rel, _ in files[start:end]}
    assert end - start >= 5 and len(valid_packages) >= 3, files[start:end]


def test_default_corpus_interrupted_build_is_not_trusted(tmp_path: Path, monkeypatch) -> None:
    real = default_corpus.encode_to_indexed

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(default_corpus, "encode_to_indexed", killed)
    with pytest.raises(KeyboardInterrupt):
        default_corpus.build_default_corpus(tmp_path, **TINY)
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    # A SIGKILLed builder cannot clean up: fake its leftover temp dir, half written.
    key = _only_key(tmp_path)
    stale = tmp_path / f".stdlib-{key}.dead.tmp"
    stale.mkdir()
    (stale / "corpus.bin").write_bytes(b"\0" * 10)
    monkeypatch.setattr(default_corpus, "encode_to_indexed", real)
    prefix, _ = default_corpus.build_default_corpus(tmp_path, **TINY)
    assert not stale.exists() and len(IndexedDataset(prefix)) > 0


def _only_key(cache_dir: Path) -> str:
    (lock,) = cache_dir.glob(".stdlib-*.lock")
    return lock.name[len(".stdlib-") : -len(".lock")]


def test_default_corpus_concurrent_callers_build_once(tmp_path: Path) -> None:
    script = (
        "import sys, time; from engine.data import default_corpus as dc\n"
        "real = dc._build\n"
        "def build(*a, **k):\n    print('BUILT', flush=True); time.sleep(1); real(*a, **k)\n"
        "dc._build = build\n"
        f"print(dc.build_default_corpus(sys.argv[1], **{TINY!r})[0])\n"
    )
    env = subprocess_env(REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(out.count("BUILT") for out in outputs) == 1
    assert outputs[0][-1] == outputs[1][-1] and len(IndexedDataset(outputs[0][-1])) > 0
