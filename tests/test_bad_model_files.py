"""A damaged model export or Hugging Face directory is refused in one line naming the file.

An export (``tools/checkpoint.py export-model``, or a run's ``ROOT/final``) is
meshtron.json, model.safetensors and tokenizer.json. Before, a truncated weights file, an
empty tokenizer, a meshtron.json that was no object, lacked its model_config or gave a size
as a string, and an HF tokenizer_config.json that was no object each crashed serve,
generate and convert_hf with a traceback (exit 1); convert_hf even exported the string
size into config.json. A meshtron.json that was not JSON was refused without its name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from apps.serving.text import TextCodec
from engine.checkpoint.format import META_FILE, WEIGHTS_FILE, read_checkpoint
from engine.checkpoint.tokenizer import TOKENIZER_FILE, write_hf_tokenizer
from engine.hf_interop import export_hf
from engine.inference import ModelSource
from engine.models import ModelConfig
from tests.test_bad_input import _tool
from tests.test_generate_tool import _export


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    directory, _, _ = _export(tmp_path_factory.mktemp("bad_model_files"))
    return directory


@pytest.fixture(scope="module")
def hf_dir(export, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_model_files_hf") / "hf"
    export_hf(export, out)
    return out


def _edit_meta(change):
    def edit(directory: Path) -> None:
        path = directory / META_FILE
        meta = json.loads(path.read_text())
        change(meta)
        path.write_text(json.dumps(meta))

    return edit


def _truncate(directory: Path) -> None:
    path = directory / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:3000])


# (id, damage, the file named, a fragment of the message)
META_DAMAGE = [
    ("no_model_config", _edit_meta(lambda m: m.pop("model_config")), META_FILE, "model_config"),
    ("a_list", lambda d: (d / META_FILE).write_text("[]"), META_FILE, "list"),
    ("not_json", lambda d: (d / META_FILE).write_text("{bad"), META_FILE, "not valid JSON"),
    (
        "size_a_string",
        _edit_meta(lambda m: m["model_config"].update(hidden_size="128")),
        META_FILE,
        "hidden_size",
    ),
    (
        "config_a_list",
        _edit_meta(lambda m: m.update(model_config=[])),
        META_FILE,
        "model_config",
    ),
]
WEIGHTS_DAMAGE = [("truncated", _truncate, WEIGHTS_FILE, "safetensors")]
TOKENIZER_DAMAGE = [
    ("empty", lambda d: (d / TOKENIZER_FILE).write_text("{}"), TOKENIZER_FILE, "tokenizer")
]


def _damaged(export: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(export, copy)
    damage(copy)
    return copy


def _assert_names(err: pytest.ExceptionInfo, path: Path, fragment: str) -> None:
    message = str(err.value)
    assert str(path) in message and fragment in message, message
    assert "\n" not in message, message


@pytest.mark.parametrize(
    ("damage", "name", "fragment"),
    [c[1:] for c in META_DAMAGE + WEIGHTS_DAMAGE],
    ids=[c[0] for c in META_DAMAGE + WEIGHTS_DAMAGE],
)
def test_read_checkpoint_names_the_damaged_file(export, tmp_path, damage, name, fragment):
    """What serve, generate's ranks and convert_hf export read the export with."""
    copy = _damaged(export, tmp_path, damage)
    with pytest.raises(ValueError) as err:
        read_checkpoint(copy)
    _assert_names(err, copy / name, fragment)


@pytest.mark.parametrize(
    ("damage", "name", "fragment"),
    [c[1:] for c in META_DAMAGE],
    ids=[c[0] for c in META_DAMAGE],
)
def test_model_source_config_names_the_damaged_meta(export, tmp_path, damage, name, fragment):
    """What serve and generate check first, before any weights are read."""
    copy = _damaged(export, tmp_path, damage)
    with pytest.raises(ValueError) as err:
        ModelSource(str(copy)).config()
    _assert_names(err, copy / name, fragment)


def test_model_source_check_weights_names_a_truncated_file(export, tmp_path):
    copy = _damaged(export, tmp_path, _truncate)
    ModelSource(str(export)).check_weights()  # the undamaged one passes
    with pytest.raises(ValueError) as err:
        ModelSource(str(copy)).check_weights()
    _assert_names(err, copy / WEIGHTS_FILE, "safetensors")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("128", "hidden_size"), (128.0, "hidden_size"), (True, "hidden_size"), (None, "hidden_size")],
)
def test_model_config_from_dict_checks_types(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        ModelConfig.from_dict({"hidden_size": value})


def test_model_config_from_dict_keeps_good_values():
    cfg = ModelConfig(hidden_size=64, num_heads=4, ffn_hidden_size=None, rope_theta=500.0)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict({"rope_theta": 500}).rope_theta == 500.0  # an int is a float
    with pytest.raises(ValueError, match="object"):
        ModelConfig.from_dict([])


def test_text_codec_names_an_empty_tokenizer(export, tmp_path):
    """serve's tokenizer load."""
    copy = _damaged(export, tmp_path, TOKENIZER_DAMAGE[0][1])
    with pytest.raises(ValueError) as err:
        TextCodec.from_files(str(copy / TOKENIZER_FILE))
    _assert_names(err, copy / TOKENIZER_FILE, "tokenizer")


def test_hf_export_names_an_empty_tokenizer(export, tmp_path):
    """convert_hf export's tokenizer load."""
    copy = _damaged(export, tmp_path, TOKENIZER_DAMAGE[0][1])
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(ValueError) as err:
        write_hf_tokenizer(copy / TOKENIZER_FILE, out, arch="gpt", max_positions=64)
    _assert_names(err, copy / TOKENIZER_FILE, "tokenizer")


@pytest.mark.parametrize(("text", "fragment"), [("[]", "list"), ("{bad", "not valid JSON")])
def test_text_codec_names_a_bad_tokenizer_config(hf_dir, tmp_path, text, fragment):
    """serve --hf-dir reads the tokenizer_config.json beside the tokenizer."""
    copy = tmp_path / "hf"
    shutil.copytree(hf_dir, copy)
    (copy / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError) as err:
        TextCodec.from_files(str(copy / TOKENIZER_FILE))
    _assert_names(err, copy / "tokenizer_config.json", fragment)


def test_convert_hf_export_refuses_a_string_size(export, tmp_path, capsys):
    """It wrote ``"n_embd": "128"`` into config.json, which its own import then refused."""
    copy = _damaged(export, tmp_path, META_DAMAGE[3][1])
    out = tmp_path / "out"
    assert _tool("convert_hf").main(["export", "--ckpt", str(copy), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(copy / META_FILE) in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize(
    ("damage", "name"),
    [(_truncate, WEIGHTS_FILE), (META_DAMAGE[1][1], META_FILE)],
    ids=["truncated_weights", "meta_a_list"],
)
def test_generate_refuses_a_damaged_export_in_one_line(export, tmp_path, damage, name, capsys):
    copy = _damaged(export, tmp_path, damage)
    code = _tool("generate").main(["--ckpt", str(copy), "--prompt", "hi", "--max-new-tokens", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(copy / name) in lines[0], (code, lines)
