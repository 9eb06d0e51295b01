"""Data formats from elsewhere: Megatron-LM ``.bin/.idx`` both ways, Parquet, ``.jsonl.gz``,
``.jsonl.zst``, the ``convert`` subcommand, and the ``--vocab-size`` bounds.

References: megatron-core's own ``IndexedDatasetBuilder`` and ``IndexedDataset`` (a test-only
dependency), the ``tokenizers`` library's ``encode`` on each document, and the same text
written as plain JSONL. Token ids are integers: every comparison is exact.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers

from engine.data.indexed import IndexedDataset, IndexedDatasetWriter, convert_index
from engine.data.preprocess import (
    EOD_TOKEN,
    expand_inputs,
    iter_documents,
    preprocess,
    vocab_ceiling,
)
from tests.corpus import build_test_corpus, documents
from tests.launch_util import TINY_RUN
from tests.multiproc import subprocess_env

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "preprocess_data.py"
# megatron-core's builder calls numpy.array on a tensor in a way numpy 2 warns about.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16]  # Megatron's integer codes


def _megatron():
    """megatron-core's indexed_dataset module, or a skip saying why it is missing."""
    with warnings.catch_warnings():  # it warns that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        return pytest.importorskip(
            "megatron.core.datasets.indexed_dataset",
            reason="megatron-core is not installed (pip install -e '.[dev]' installs it)",
        )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """The fixed test corpus as a meshtron pair, and its 512-id tokenizer."""
    return build_test_corpus(tmp_path_factory.mktemp("corpus"))


def _encode_docs(tokenizer_path: str, texts: list[str]) -> list[np.ndarray]:
    """Each document's ids then the end-of-document id, encoded independently of preprocess."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.encode_special_tokens = True
    eod = tokenizer.token_to_id(EOD_TOKEN)
    return [
        np.array(tokenizer.encode(t, add_special_tokens=False).ids + [eod], dtype=np.int64)
        for t in texts
    ]


def _megatron_docs(mcore, prefix: str) -> list[np.ndarray]:
    """Per-document ids as megatron-core reads them (a document's sequences concatenated)."""
    dataset = mcore.IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [
        np.concatenate([dataset[s] for s in range(bounds[d], bounds[d + 1])] or [[]]).astype(
            np.int64
        )
        for d in range(len(bounds) - 1)
    ]


def _our_docs(prefix: str, **kwargs) -> list[np.ndarray]:
    dataset = IndexedDataset(prefix, **kwargs)
    return [dataset.doc(i).astype(np.int64) for i in range(len(dataset))]


def _assert_docs_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"document {i}")


def _build_megatron(mcore, prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> None:
    builder = mcore.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(prefix) + ".idx")


# ---------------------------------------------------------------- Megatron, read


@pytest.mark.slow
def test_megatron_core_pair_trains(corpus, tmp_path: Path) -> None:
    """A pair from megatron-core's builder: the same ids per document, the same batches as
    our own pair of the same documents, and a real two-step ``python -m engine.pretrain``."""
    mcore = _megatron()
    prefix, tokenizer = corpus
    want = _encode_docs(tokenizer, documents())
    _build_megatron(mcore, tmp_path / "mc", want)  # uint16: what Megatron picks for 512 ids
    eod = Tokenizer.from_file(tokenizer).token_to_id(EOD_TOKEN)
    ours = IndexedDataset(tmp_path / "mc", eod_id=eod)
    assert ours.format == "megatron" and ours.dtype == np.uint16
    _assert_docs_equal(_our_docs(str(tmp_path / "mc"), eod_id=eod), want)
    _assert_docs_equal(_our_docs(prefix), want)
    # The token files are the same bytes: only the index differs.
    assert Path(prefix + ".bin").read_bytes() == (tmp_path / "mc.bin").read_bytes()
    overrides = [
        f"data.tokenizer={tokenizer}",
        *TINY_RUN,
        "trainer.global_batch=4",
        "trainer.micro_batch=2",
        "trainer.eval_every=0",
        "trainer.tensorboard=false",
        "trainer.progress=false",
        "trainer.sample_tokens=0",
        "trainer.device=cpu",
        "trainer.log_every=1",
        "tp_size=1",
        "dp_size=1",
    ]
    for arch in (["model=gpt_tiny"], ["model=bert_tiny"]):  # GPT windows, BERT spans and masks
        batches = [_first_batches(p, overrides + arch) for p in (prefix, str(tmp_path / "mc"))]
        torch.testing.assert_close(batches[1], batches[0], rtol=0, atol=0)  # ids: exact
    run = [
        sys.executable,
        "-m",
        "engine.pretrain",
        f"data.prefixes=[{tmp_path / 'mc'}]",
        *overrides,
        "trainer.max_steps=2",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.save_final=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**subprocess_env(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"step +\d+/2 +loss +(\S+)", done.stdout)]
    # Two logged steps, each near ln 512 = 6.24 nats (an untrained model's loss over 512 ids).
    assert len(losses) == 2 and all(abs(v - math.log(512)) < 0.5 for v in losses), losses


def _first_batches(prefix: str, overrides: list[str]) -> list:
    """The micro-batches of the first 3 steps the trainer's data path serves from ``prefix``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from engine.config import register_configs
    from engine.data.run_data import build_run_data, check_data

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", [f"data.prefixes=[{prefix}]", *overrides]))
    assert check_data(cfg) == []
    train = build_run_data(cfg, batch_rank=0, batch_size=1).train
    return [micro for _ in range(3) for micro in next(train)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_megatron_integer_dtype_reads(tmp_path: Path, dtype) -> None:
    mcore = _megatron()
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 100, size=n), 0) for n in (3, 0, 17, 1)]
    docs[2][5] = 99  # the largest id, so that a 99-id vocabulary must be refused
    _build_megatron(mcore, tmp_path / "d", docs, dtype=dtype)
    dataset = IndexedDataset(tmp_path / "d", eod_id=0)
    assert dataset.dtype == np.dtype(dtype) and dataset.eod_id == 0
    _assert_docs_equal(_our_docs(str(tmp_path / "d"), eod_id=0), docs)
    dataset.verify(100)
    with pytest.raises(ValueError, match=r"token ids 0\.\.99, outside the model's vocabulary"):
        dataset.verify(99)


def test_megatron_documents_of_several_sequences(tmp_path: Path) -> None:
    """``--split-sentences`` data: a document is its sequences; splits count documents."""
    mcore = _megatron()
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.uint16)
    sentences = [[[5, 6], [7, 8, 9]], [[10]], [], [[11, 12], [13], [14, 0]]]
    for doc in sentences:
        for sentence in doc:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(str(tmp_path / "s.idx"))
    dataset = IndexedDataset(tmp_path / "s")  # no eod id known: Megatron does not record one
    assert len(dataset) == 4 and dataset.eod_id is None
    want = [np.array(sum(doc, []), dtype=np.int64) for doc in sentences]
    _assert_docs_equal(_our_docs(str(tmp_path / "s")), want)
    _assert_docs_equal(_megatron_docs(mcore, str(tmp_path / "s")), want)
    lengths, starts = dataset.sequences()
    np.testing.assert_array_equal(lengths, [2, 3, 1, 2, 1, 2])
    np.testing.assert_array_equal(starts, [0, 2, 3, 3, 6])
    dataset.verify(15)  # no end-of-document check: Megatron appends one only if asked


def test_damaged_megatron_index_is_one_line(tmp_path: Path) -> None:
    mcore = _megatron()
    _build_megatron(mcore, tmp_path / "f", [np.array([1, 2, 0])], dtype=np.float32)
    with pytest.raises(ValueError, match=r"f\.idx: Megatron token dtype float32 cannot hold"):
        IndexedDataset(tmp_path / "f")
    _build_megatron(mcore, tmp_path / "t", [np.array([1, 2, 0]), np.array([3, 0])])
    raw = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match=r"t\.idx: \d+ bytes, expected \d+ for 2 sequences"):
        IndexedDataset(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(raw)
    (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"t\.bin: 8 bytes, but t\.idx expects 5 tokens"):
        IndexedDataset(tmp_path / "t")


# ---------------------------------------------------------------- Megatron, write and convert


def test_format_megatron_reads_back_in_megatron_core(corpus, tmp_path: Path) -> None:
    mcore = _megatron()
    _, tokenizer = corpus
    texts = documents()[:20]
    docs = _write_jsonl(tmp_path / "docs.jsonl", texts)
    done = _preprocess(docs, tmp_path / "m", "--tokenizer", tokenizer, "--format", "megatron")
    assert done.returncode == 0, done.stderr
    want = _encode_docs(tokenizer, texts)
    _assert_docs_equal(_megatron_docs(mcore, str(tmp_path / "m")), want)
    # The index is byte for byte what megatron-core's own builder writes for these documents.
    _build_megatron(mcore, tmp_path / "ref", want)
    assert (tmp_path / "m.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_convert_rewrites_only_the_index(corpus, tmp_path: Path) -> None:
    mcore = _megatron()
    prefix, tokenizer = corpus
    for ext in (".bin", ".idx"):
        (tmp_path / f"c{ext}").write_bytes(Path(prefix + ext).read_bytes())
    before = (tmp_path / "c.bin").stat()
    original_idx = (tmp_path / "c.idx").read_bytes()
    want = _encode_docs(tokenizer, documents())
    done = _cli("convert", str(tmp_path / "c"), "--to", "megatron")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(
        "meshtron -> megatron (" + str(tmp_path / "c") + ".bin unchanged)"
    )
    _assert_docs_equal(_megatron_docs(mcore, str(tmp_path / "c")), want)
    done = _cli("convert", str(tmp_path / "c"), "--to", "meshtron", "--tokenizer", tokenizer)
    assert done.returncode == 0, done.stderr
    # Back where it started: the same checksum, id range and offsets, byte for byte.
    assert (tmp_path / "c.idx").read_bytes() == original_idx
    after = (tmp_path / "c.bin").stat()
    assert (after.st_mtime_ns, after.st_ino, after.st_size) == (
        before.st_mtime_ns,
        before.st_ino,
        before.st_size,
    )
    assert (tmp_path / "c.bin").read_bytes() == Path(prefix + ".bin").read_bytes()


def test_convert_errors_are_one_line(tmp_path: Path) -> None:
    mcore = _megatron()
    _build_megatron(
        mcore, tmp_path / "n", [np.array([3, 4]), np.array([5, 0])]
    )  # no eod after doc 0
    done = _cli("convert", str(tmp_path / "n"), "--to", "meshtron")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"preprocess_data.py convert: error: {tmp_path}/n.idx: a meshtron index records the "
        "end-of-document id; give --eod-id N or --tokenizer PATH"
    ]
    done = _cli("convert", str(tmp_path / "n"), "--to", "meshtron", "--eod-id", "0")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert (
        "document 0 does not end with eod_id=0 (made without Megatron's --append-eod" in done.stderr
    )
    done = _cli("convert", str(tmp_path / "n"), "--to", "megatron")
    assert done.returncode == 2
    assert done.stderr.strip().endswith("n.idx is already a megatron index")
    _build_megatron(mcore, tmp_path / "w", [np.array([3, 0])], dtype=np.int64)
    done = _cli("convert", str(tmp_path / "w"), "--to", "meshtron", "--eod-id", "0")
    assert done.returncode == 2 and "token dtype int64 has no meshtron equivalent" in done.stderr


def test_convert_refuses_a_bin_its_index_checksum_disowns(tmp_path: Path) -> None:
    """A meshtron .bin changed after preprocessing is refused, not converted: the Megatron
    index records no checksum, so converting would leave the damage undetectable."""
    with IndexedDatasetWriter(tmp_path / "d", vocab_size=100, eod_id=0) as writer:
        for doc in ([5, 6, 0], [7, 0]):
            writer.add_document(np.array(doc))
    data = bytearray((tmp_path / "d.bin").read_bytes())
    data[0] ^= 1  # one bit of the first id: same size, only the checksum can tell
    (tmp_path / "d.bin").write_bytes(bytes(data))
    index = (tmp_path / "d.idx").read_bytes()
    with pytest.raises(ValueError, match="d.bin: SHA-256 does not match the one d.idx recorded"):
        convert_index(tmp_path / "d", "megatron")
    assert (tmp_path / "d.idx").read_bytes() == index  # untouched


def test_writer_megatron_dtype_for_large_vocabularies(tmp_path: Path) -> None:
    """Megatron stores ids of vocabularies from 65,500 up as int32 (DType.optimal_dtype)."""
    mcore = _megatron()
    docs = [np.array([70_000, 1, 65_535]), np.array([2])]
    with IndexedDatasetWriter(
        tmp_path / "big", vocab_size=100_000, eod_id=0, index_format="megatron"
    ) as writer:
        for doc in docs:
            writer.add_document(doc)
    assert mcore.IndexedDataset(str(tmp_path / "big")).index.dtype == np.int32
    want = [np.append(d, 0) for d in docs]
    _assert_docs_equal(_megatron_docs(mcore, str(tmp_path / "big")), want)
    convert_index(tmp_path / "big", "meshtron", eod_id=0)
    converted = IndexedDataset(tmp_path / "big")
    assert converted.dtype == np.uint32 and converted.token_range == (0, 70_000)
    converted.verify(100_000)
    _assert_docs_equal(_our_docs(str(tmp_path / "big")), want)


# ---------------------------------------------------------------- corpora as people have them


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(CLI), *args]
    if args[0] != "convert":
        cmd.append("--no-progress")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    """``texts`` as JSONL lines ``{"text": ...}`` at ``path``."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _preprocess(
    source: Path | str, output_prefix: Path, *args: str, text_key: str | None = "text"
) -> subprocess.CompletedProcess:
    """The CLI on ``source`` (its ``text_key`` fields; None: no --text-key), writing
    ``output_prefix``.bin/.idx."""
    key = ("--text-key", text_key) if text_key is not None else ()
    return _cli("--input", str(source), *key, "--output-prefix", str(output_prefix), *args)


TEXTS = [
    "Hello, world!\n",
    "unicode: héllo wörld — ñ 日本語 🙂 e\u0301 (combining)\r\nwindows line end\r\n",
    "",
    '  a literal <|endoftext|> and "quotes" \\ backslashes',
]


@pytest.fixture(scope="module")
def plain_jsonl(corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """TEXTS (repeated past one 1024-row Parquet batch) preprocessed from plain JSONL."""
    _, tokenizer = corpus
    directory = tmp_path_factory.mktemp("plain")
    texts = [f"{i}: {t}" for i in range(700) for t in TEXTS[i % 2 :: 2]]
    _write_jsonl(directory / "all.jsonl", texts)
    preprocess(
        [str(directory / "all.jsonl")],
        str(directory / "ref"),
        json_key="text",
        tokenizer_path=tokenizer,
        progress=False,
    )
    return directory / "ref", texts


def _jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _write_shards(directory: Path, texts: list[str], kind: str) -> str:
    """The texts in three shards of ``kind``; returns the --input to read them all."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    thirds = [texts[:1100], texts[1100:1250], texts[1250:]]  # 1100 > a 1024-row batch
    for i, part in enumerate(thirds):
        if kind == "parquet":  # a partitioned folder, as Hugging Face datasets publish them
            shard = directory / f"lang=x/part={i}" / "data.parquet"
            shard.parent.mkdir(parents=True)
            table = pa.table({"id": list(range(len(part))), "text": part})
            pq.write_table(table, shard, row_group_size=300)  # several row groups per shard
        elif kind == "gz":
            (directory / f"s{i}.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(part)))
        else:  # zst, the middle shard as two concatenated frames as parallel compressors write
            data = _jsonl_bytes(part)
            frames = [data[: len(data) // 2], data[len(data) // 2 :]] if i == 1 else [data]
            compressor = zstandard.ZstdCompressor(level=3)
            (directory / f"s{i}.jsonl.zst").write_bytes(b"".join(map(compressor.compress, frames)))
    return str(directory) if kind == "parquet" else str(directory / f"*.jsonl.{kind}")


@pytest.mark.parametrize("kind", ["parquet", "gz", "zst"])
def test_compressed_and_parquet_inputs_give_plain_jsonl_tokens(corpus, plain_jsonl, tmp_path, kind):
    _, tokenizer = corpus
    reference, texts = plain_jsonl
    (tmp_path / "in").mkdir()
    source = _write_shards(tmp_path / "in", texts, kind)
    done = _preprocess(source, tmp_path / "out", "--tokenizer", tokenizer, "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert f"{len(texts)} documents" in done.stdout
    for ext in (".bin", ".idx"):  # same ids, same documents, same checksum
        assert (tmp_path / f"out{ext}").read_bytes() == Path(f"{reference}{ext}").read_bytes()
    _assert_docs_equal(_our_docs(str(tmp_path / "out")), _encode_docs(tokenizer, texts))
    # The progress bar's bytes add up to the files' sizes (compressed sizes), so it ends at 100 %.
    shards = expand_inputs([source])
    if kind == "parquet":  # a folder is its Parquet files, as a ** glob finds them
        assert shards == expand_inputs([f"{source}/**/*.parquet"]) and len(shards) == 3
    assert sum(n for _, n in iter_documents(shards, json_key="text")) == sum(
        p.stat().st_size for p in shards
    )


@pytest.mark.slow
def test_bad_corpora_are_one_line(corpus, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, tokenizer = corpus
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "fake.parquet").write_text('{"text": "I am JSON"}\n')
    good = json.dumps({"text": "fine"}) + "\n"
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress((good * 2 + "{oops\n").encode()))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress((good * 500).encode())[:-30])
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd at all")
    cases = [
        (
            "nocol.parquet",
            "nocol.parquet: no column 'text' (columns: body); choose one with --text-key",
        ),
        ("null.parquet", "null.parquet: row 1: 'text' is null, expected a string"),
        ("ints.parquet", "ints.parquet: column 'text' holds int64, expected strings"),
        ("fake.parquet", "fake.parquet: not a Parquet file ("),
        ("bad.jsonl.gz", "bad.jsonl.gz:3: invalid JSON (Expecting property name"),
        ("cut.jsonl.gz", "cut.jsonl.gz:"),
        ("junk.jsonl.zst", "junk.jsonl.zst:1: cannot decompress ("),
    ]
    for name, message in cases:
        done = _preprocess(tmp_path / name, tmp_path / "o", "--tokenizer", tokenizer)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (name, done.stderr)
        assert lines[0].startswith(f"preprocess_data.py: error: {tmp_path}/{message}"), lines
    done = _preprocess(
        tmp_path / "ints.parquet", tmp_path / "o", "--tokenizer", tokenizer, text_key=None
    )
    assert done.stderr.strip().endswith("ints.parquet: a Parquet input needs --text-key COLUMN")
    # JSONL likewise: read as text, its JSON syntax became one document (of training data)
    (tmp_path / "records.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    done = _preprocess(
        tmp_path / "records.jsonl", tmp_path / "o", "--tokenizer", tokenizer, text_key=None
    )
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip().endswith(
        "records.jsonl: a JSONL input needs --text-key KEY, the key holding each document "
        "(e.g. --text-key text)"
    ), done.stderr
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob(".o*"))


# ---------------------------------------------------------------- vocabulary size


def test_vocab_size_beyond_the_corpus_is_refused_before_training(tmp_path: Path) -> None:
    """1e9 ids once aborted the process inside the tokenizers library (a 70 GB allocation)."""
    (tmp_path / "a.txt").write_text("the cat sat on the mat, the end")
    done = _preprocess(
        tmp_path / "a.txt", tmp_path / "o", "--vocab-size", "1000000000", text_key=None
    )
    # The bound counts pieces split where a space follows a non-space (no pre-tokenized word
    # crosses that): the, " cat", " sat", " on", " the", " mat,", " end" are the distinct
    # ones, allowing 2+3+3+2+3+4+3 = 20 merges: at most 256 bytes + 5 specials + 20 = 281 ids.
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "preprocess_data.py: error: vocab size 1000000000 (--vocab-size) is more than this "
        "corpus can yield: a byte-level BPE trained on it has at most 281 ids; give "
        "--vocab-size 281 or less, or more text"
    ]
    assert not list(tmp_path.glob("o*"))
    done = _preprocess(tmp_path / "a.txt", tmp_path / "o", "--vocab-size", "281", text_key=None)
    assert done.returncode == 0, done.stderr
    # Its true words (Ġmat and "," apart) allow 19 merges: the BPE stops at 280 ids or fewer.
    got = Tokenizer.from_file(str(tmp_path / "o.tokenizer.json")).get_vocab_size()
    assert got <= 280 and f"the trained vocabulary has {got} ids" in done.stderr


def test_smaller_vocabulary_than_asked_is_reported(tmp_path: Path) -> None:
    texts = documents()[:40]
    docs = _write_jsonl(tmp_path / "d.jsonl", texts)
    done = _preprocess(docs, tmp_path / "o", "--vocab-size", "2000")
    assert done.returncode == 0, done.stderr
    tokenizer = Tokenizer.from_file(str(tmp_path / "o.tokenizer.json"))
    got = tokenizer.get_vocab_size()
    assert got < 2000
    assert done.stderr.strip().splitlines() == [
        f"preprocess_data.py: note: the trained vocabulary has {got} ids, fewer than the 2000 "
        "asked: BPE ran out of pairs to merge (every word of the corpus is already one token); "
        f"more text gives more ids, and model.vocab_size={got} is enough for this tokenizer"
    ]
    # The reason holds: every distinct pre-tokenized word of the corpus is a single token.
    words = {
        w
        for t in texts
        for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(t)
    }
    assert all(len(tokenizer.model.tokenize(w)) == 1 for w in words)


def test_vocab_ceiling_bounds_the_pre_tokenizers_words() -> None:
    """The fast bound is never below the one from the library's own pre-tokenized words."""
    texts = [*TEXTS, "a  b\t\tc\n\n\nd   ", "x=f(y,z);  # it's 12.5%\r\n", " \n", *documents()[:5]]
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = {w for t in texts for w, _ in pre.pre_tokenize_str(t)}
    exact = 261 + sum(len(w) - 1 for w in words)  # byte-level: one character per byte
    ceiling = vocab_ceiling(texts, 10**9)
    assert ceiling is not None and ceiling >= exact
    assert vocab_ceiling(texts, ceiling) is None and vocab_ceiling(texts, ceiling + 1) == ceiling
