"""The tokenizer that belongs to a model: recorded by its checkpoints, carried by its exports.

A training checkpoint records the ``tokenizer.json`` its run read (absolute path and
SHA-256), so generation and evaluation find it and notice when the file there changed. A
model export (``ROOT/final``, ``tools/checkpoint.py export-model``) holds a copy as
``tokenizer.json``; a Hugging Face export adds ``tokenizer_config.json`` and
``special_tokens_map.json``, so ``AutoTokenizer.from_pretrained(DIR)`` opens it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.data.fsutil import file_problem
from engine.models.families import family

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
# The Hugging Face files that say how a tokenizer is used (its bos/eos, a chat template):
# an imported model keeps them beside its tokenizer.json, and its export gives them back.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _sha256(path: str | os.PathLike) -> str:
    # hashlib's own file digest: importing storage's would close a circle (storage imports
    # format, which imports this module).
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_record(path: str | os.PathLike | None) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of the tokenizer file at ``path`` (``None`` if there is none)."""
    if path is None or not os.path.isfile(path):
        return None
    return {"path": str(Path(path).resolve()), "sha256": _sha256(path)}


def recorded_tokenizer(trainer_state: dict[str, Any] | None) -> str | None:
    """The tokenizer a training checkpoint's ``trainer_state`` names, if the file is there.

    Raises ValueError when the file at the recorded path is no longer the one trained with
    (its SHA-256 differs): its ids would not be the model's. Checkpoints written before the
    record existed give the run config's ``data.tokenizer``, unchecked.
    """
    state = trainer_state or {}
    record = state.get("tokenizer")
    if record is None:
        path = ((state.get("config") or {}).get("data") or {}).get("tokenizer")
        return path if path and os.path.isfile(path) else None
    path = record["path"]
    if not os.path.isfile(path):
        return None
    if _sha256(path) != record["sha256"]:
        raise ValueError(
            f"{path} is not the tokenizer this model was trained with (SHA-256 "
            f"{record['sha256'][:12]}… recorded); pass --tokenizer with the original file"
        )
    return path


def copy_tokenizer(path: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Put a copy of the tokenizer file at ``directory/tokenizer.json``."""
    shutil.copyfile(path, Path(directory) / TOKENIZER_FILE)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The ``tokenizers`` Tokenizer in file ``path``; a one-line ValueError naming the file
    when it is missing or not one (the library raises a bare Exception, ``Model missing.``
    for ``{}``)."""
    from tokenizers import Tokenizer

    if problem := file_problem(path):  # a FIFO would wait for a writer
        raise ValueError(f"{path} {problem}; a tokenizer.json file is read")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library's errors are plain Exceptions
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(f"{path} is not a tokenizer file ({first})") from None


def check_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """Raise a one-line ValueError unless ``path`` is a tokenizer file the ``tokenizers``
    library reads whose ids all fit a model of ``vocab_size`` (an id past the embedding
    table would fail only when generating)."""
    vocab = load_tokenizer(path).get_vocab(with_added_tokens=True)
    largest = max(vocab.values(), default=-1)
    if largest >= vocab_size:
        raise ValueError(f"{path} has token id {largest}, past the model's vocab_size {vocab_size}")


TYPED_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def write_hf_tokenizer(
    path: str | os.PathLike, hf_dir: str | os.PathLike, *, arch: str, max_positions: int
) -> dict[str, int]:
    """Write ``tokenizer.json`` and the Hugging Face files that name its special tokens
    (the roles ``arch``'s family names, ``Family.special_tokens``; only tokens the
    vocabulary holds), for ``AutoTokenizer.from_pretrained(hf_dir)``.
    Returns their ids by config.json key (``eos_token_id``: 0 ...), which the model's
    config must carry too."""
    tokenizer = load_tokenizer(path)  # read first: a damaged file is named, not copied
    vocab = tokenizer.get_vocab()
    roles = {}  # each role the family names: its first token the vocabulary holds
    for role, tokens in family(arch).special_tokens.items():
        held = [token for token in tokens if token in vocab]
        if held:
            roles[role] = held[0]
    if (
        family(arch).token_types
        and _adds_no_specials(tokenizer)
        and {"cls_token", "sep_token"} <= roles.keys()
    ):
        _add_pair_template(tokenizer, roles["cls_token"], roles["sep_token"], vocab)
        tokenizer.save(str(Path(hf_dir) / TOKENIZER_FILE))
    else:
        copy_tokenizer(path, hf_dir)
    config = {
        # An encoder trained on sentence pairs feeds token types (transformers' fast
        # tokenizer returns them only when named here).
        **({"model_input_names": list(TYPED_INPUTS)} if family(arch).token_types else {}),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        **roles,
    }
    for name, body in (("tokenizer_config.json", config), ("special_tokens_map.json", roles)):
        (Path(hf_dir) / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return {f"{role}_id": vocab[token] for role, token in roles.items() if role != "unk_token"}


def _adds_no_specials(tokenizer) -> bool:
    """Whether encoding with ``tokenizer`` adds no special tokens of its own (a tokenizer
    trained here; an imported BERT tokenizer already has its template)."""
    return (
        tokenizer.encode("a", add_special_tokens=True).ids
        == tokenizer.encode("a", add_special_tokens=False).ids
    )


def _add_pair_template(tokenizer, cls: str, sep: str, vocab: dict[str, int]) -> None:
    """Make ``tokenizer`` frame text as the BERT pre-training samples are: ``[CLS] A [SEP]``
    and, for a pair, ``[CLS] A [SEP] B [SEP]`` with token type 0 up to the first [SEP] and
    1 after it (``engine/data/bert_dataset.py``), as transformers' BERT tokenizers do.
    Training data is tokenized with ``add_special_tokens=False``: it is not affected."""
    from tokenizers import processors

    template = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    current = tokenizer.post_processor
    tokenizer.post_processor = (
        template if current is None else processors.Sequence([current, template])
    )
