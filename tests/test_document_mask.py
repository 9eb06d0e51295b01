"""Document-masked packing (``data.document_mask``): a packed window whose documents see
only themselves equals the same documents run one per row.

The windows come from a real indexed dataset with documents of awkward lengths (1 to 9
tokens plus the end-of-document token), so the document ids are derived from the stored
offsets exactly as in training. The reference runs each document's part of a window as
its own row, unpacked and unmasked, with the same labels (the last token of a document
keeps its label, the next document's first token). Everything is fp64: masked keys add
exact zeros and the rest only reorders sums of O(1) terms, so 1e-12 leaves three orders
of margin above rounding (measured ~1e-15), while a position not reset or a key seen
across documents is off by O(1e-2).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from engine.data import GPTDataset, IndexedDataset
from engine.data.indexed import IndexedDatasetWriter
from engine.data.loader import collate
from engine.models import build_model
from engine.models.config import preset
from tests.multiproc import run_ranks
from tests.test_context_parallel import MODELS, SMALL, VOCAB  # the same tiny pair

SEQ = 16
EOD = VOCAB - 1
PACKED_TOL = 1e-12  # fp64, packed against one document per row; see the module docstring
CP_TOL = 1e-10  # fp64, cp 2 against the unsplit model, as tests/test_context_parallel.py


def _model(name: str):
    preset_name, extra = MODELS[name]
    torch.manual_seed(5)
    return build_model(preset(preset_name, **SMALL, **extra), dtype=torch.float64)


def _indexed(path) -> IndexedDataset:
    """Documents of 1 to 9 tokens (plus EOD), ids below EOD, from a fixed generator."""
    rng = np.random.default_rng(11)
    with IndexedDatasetWriter(path / "docs", vocab_size=VOCAB, eod_id=EOD) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(0, EOD, size=int(rng.integers(1, 10))))
    return IndexedDataset(path / "docs")


def _packed_batch(path, rows: int = 2) -> dict[str, torch.Tensor]:
    dataset = GPTDataset(_indexed(path), SEQ, seed=0, document_mask=True)
    return collate([dataset[i] for i in range(rows)])


def _per_token(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed: (logits ``[b, s, V]``, losses ``[b, s]``) with the document mask."""
    ids, labels, docs = batch["input_ids"], batch["labels"], batch["document_ids"]
    return model(ids, document_ids=docs), model(ids, labels, document_ids=docs)


def _one_document_per_row(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: each document's tokens of each window run alone, no mask, their
    logits and losses put back where the packed row has them."""
    ids, labels, docs = batch["input_ids"], batch["labels"], batch["document_ids"]
    logits, losses = [], []
    for row in range(ids.shape[0]):
        for doc in docs[row].unique():
            keep = docs[row] == doc
            logits.append(model(ids[row, keep][None])[0])
            losses.append(model(ids[row, keep][None], labels[row, keep][None])[0])
    b, s = ids.shape
    return torch.cat(logits).view(b, s, -1), torch.cat(losses).view(b, s)


def _packed_error(name: str, path) -> float:
    """Largest |packed − one per row| over logits, per-token losses and gradients of the
    mean loss."""
    model = _model(name)
    batch = _packed_batch(path)
    assert all(len(row.unique()) >= 3 for row in batch["document_ids"]), batch["document_ids"]
    logits, losses = _per_token(model, batch)
    torch.testing.assert_close(model.loss(batch), losses.mean(), rtol=0, atol=0)
    want_logits, want_losses = _one_document_per_row(model, batch)
    errors = [(logits - want_logits).abs().max(), (losses - want_losses).abs().max()]
    grads = []
    for total in (losses.mean(), want_losses.mean()):
        model.zero_grad()
        total.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    errors += [(grads[0][k] - grads[1][k]).abs().max() for k in grads[0]]
    return max(e.item() for e in errors)


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_documents_equal_one_document_per_row(name, tmp_path):
    """GPT (learned positions) and Llama (rotary, GQA): logits, per-token losses and every
    gradient within 1e-12 of the documents run one per row (measured ~1e-15)."""
    error = _packed_error(name, tmp_path)
    print(f"{name}: packed vs one per row, max |error| {error:.1e}")
    assert error <= PACKED_TOL


@pytest.mark.parametrize("name", list(MODELS))
def test_positions_not_reset_are_caught(name, tmp_path, monkeypatch):
    """A planted bug: positions that run on across documents (0 … s−1 along the row).
    The same comparison then fails its 1e-12: GPT's learned table by ~0.5; Llama by ~6e-11
    only, because rotary scores depend on q and k's distance alone, which a shift inside
    one document keeps, and only the fp32 angles (``layers.rotary``) differ. So the direct
    check of the positions is ``test_positions_restart_at_each_document``."""
    import engine.models.gpt.model as gpt_model

    def not_reset(document_ids):
        b, s = document_ids.shape
        return torch.arange(s).expand(b, -1)

    monkeypatch.setattr(gpt_model, "document_positions", not_reset)
    error = _packed_error(name, tmp_path)
    print(f"{name}: positions not reset, max |error| {error:.1e}")
    assert error > (1e-4 if name == "gpt" else 10 * PACKED_TOL)


def test_positions_restart_at_each_document():
    """``document_positions`` against per-document ``arange``s (a row may start inside a
    document: it counts from the row's start), and the positions the cp shard carries."""
    from layers.documents import document_positions

    docs = torch.tensor(CP_DOCS)
    want = [
        torch.cat([torch.arange(int(n)) for n in row.unique_consecutive(return_counts=True)[1]])
        for row in docs
    ]
    assert torch.equal(document_positions(docs), torch.stack(want))


def test_document_ids_follow_the_stored_offsets(tmp_path):
    """Each input token's document is the one the index's offsets put it in (numbered from
    the window's first); the tokens are the plain windows', the labels their next tokens."""
    indexed = _indexed(tmp_path)
    plain = GPTDataset(indexed, SEQ, seed=0)
    masked = GPTDataset(indexed, SEQ, seed=0, document_mask=True)
    offsets = np.asarray(indexed.doc_offsets)
    for i in range(len(plain)):
        window, sample = plain[i], masked[i]
        assert torch.equal(sample["input_ids"], window[:-1])
        assert torch.equal(sample["labels"], window[1:])
        _, window_id = plain.shuffle(i)
        start = window_id * SEQ
        doc = [
            int(np.searchsorted(offsets, t, side="right")) - 1 for t in range(start, start + SEQ)
        ]
        assert sample["document_ids"].tolist() == [d - doc[0] for d in doc]


def test_document_mask_off_is_the_plain_window_and_loss(tmp_path):
    """``document_mask=false`` (the default): a sample is the window tensor itself, read
    straight from the token stream, and the loss of a batch of them is bit for bit the
    plain next-token call's (the path taken before document masks existed)."""
    indexed = _indexed(tmp_path)
    dataset = GPTDataset(indexed, SEQ, seed=0)
    stream = np.asarray(indexed.tokens, dtype=np.int64)
    for i in range(len(dataset)):
        _, window_id = dataset.shuffle(i)
        sample = dataset[i]
        assert type(sample) is torch.Tensor and sample.dtype == torch.int64
        start = window_id * SEQ
        assert torch.equal(sample, torch.from_numpy(stream[start : start + SEQ + 1]))
    windows = collate([dataset[i] for i in range(2)])
    for name in MODELS:
        model = _model(name)
        plain = model(windows[:, :-1], windows[:, 1:]).mean()
        assert torch.equal(model.loss(windows), plain)


def _cp2_against_unsplit(name: str, docs: list[list[int]]) -> float:
    """At cp 2: this rank's loss and full gradients of one masked packed batch through the
    local runner, against the unsplit model's; the largest error."""
    import torch.distributed as dist

    import parallel_state
    from engine import comm
    from engine.config import OptimConfig
    from engine.data_parallel import build_data_parallel
    from engine.runner import LocalRunner

    ps = parallel_state.initialize(parallel_state.ParallelDims(1, 1, cp=2))
    solo = [dist.new_group([r]) for r in range(2)][ps.rank]
    ps.seed(7)
    preset_name, extra = MODELS[name]
    cfg = preset(preset_name, **SMALL, **extra)
    model = build_model(cfg, ps, dtype=torch.float64)
    reference = build_model(cfg, tp_group=solo, rng=ps.rng, dtype=torch.float64)
    reference.load_full_state_dict(model.full_state_dict())
    ids = torch.randint(0, VOCAB, (len(docs), SEQ + 1), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "document_ids": torch.tensor(docs)}

    dp = build_data_parallel(
        model, OptimConfig(), grad_group=ps.group("grad"), tp_group=ps.group("tp"), device=ps.device
    )
    LocalRunner(model, ps, contextlib.nullcontext).forward_backward([batch], dp)
    dp.finish_grads()
    with torch.no_grad():
        loss = model.loss(model.context_shard(batch, 2, ps.rank_in("cp"))).item()
    loss = comm.mean(loss, ps.group("loss"), ps.device)
    want = reference.loss(batch)
    want.backward()
    errors = [abs(loss - want.item())]
    grads, want_grads = model.full_grad_dict(), reference.full_grad_dict()
    errors += [(grads[k] - want_grads[k]).abs().max().item() for k in want_grads]
    return max(errors)


# Rows of 16 tokens, 4 chunks of 4 at cp 2: documents that cross chunks, one that fills a
# chunk, one token alone, so some ring blocks are skipped and some masked.
CP_DOCS = [
    [0] * 3 + [1] * 6 + [2] * 2 + [3] * 5,
    [0] * 4 + [1] * 1 + [2] * 11,
]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_cp2_masked_packed_batch_equals_the_unsplit_one(name):
    """cp 2 (2 gloo ranks): the ring with document ids (positions restarted within each
    document, cut to each rank's chunks) gives the unsplit masked model's loss and every
    gradient within 1e-10 (measured ~1e-16)."""
    errors = run_ranks(_cp2_against_unsplit, 2, name, CP_DOCS)
    print(f"{name} cp2 masked: max |error| {max(errors):.1e}")
    assert max(errors) <= CP_TOL


def test_document_mask_refusals_are_one_line():
    """Before any worker starts: BERT (no causal packing). A pipeline takes the mask (its
    stages get the document ids as a keyword input; tests/test_document_mask_layouts.py)."""
    from engine.config import Config, parallel_dims, validate
    from engine.models.config import preset as model_preset

    bert = Config(tp_size=1, dp_size=1)
    bert.model = model_preset("bert_tiny")
    bert.data.document_mask = True
    found = [p for p in validate(bert, parallel_dims(bert, None)) if "document_mask" in p]
    assert found == [
        "data.document_mask=true packs causal documents (gpt, llama, gemma), not model.arch=bert"
    ]

    piped = Config(tp_size=1, dp_size=1, pp_size=2)
    piped.data.document_mask = True
    assert validate(piped, parallel_dims(piped, None)) == []
