"""The command line of ``python -m engine.pretrain`` around Hydra: its ``--help``, and
overrides naming keys that do not exist.

Hydra's own ``--help`` dumps the composed config with its internal ``schema`` options, and
for a mistyped key it suggests appending it (``+trainer.max_step=``), which is the wrong
fix. Here every key of the schema (engine/config.py) is listed with its default and its
one-line doc, grouped by section, and an unknown key is refused with the nearest real one.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from pathlib import Path

from engine.config import Config

# Keys a user never sets: the run directory is Hydra's, the fault injection a test hook.
HIDDEN = {"run_dir", "trainer.fail_at_step"}
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Hydra's flags that take the next argument as their value.
_VALUE_FLAGS = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"}
_FIELD_DOC = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def field_docs(cls: type) -> dict[str, str]:
    """{field: its one-line doc}, the comment after each field of the dataclass ``cls``."""
    docs = {}
    for line in inspect.getsource(cls).splitlines():
        match = _FIELD_DOC.match(line)
        if match:
            docs[match.group(1)] = match.group(2).strip()
    return docs


def schema_keys(*, hidden: bool = False) -> dict[str, tuple[str, str]]:
    """{dotted key: (section, doc)} of every key, in the schema's order; ``hidden``: with
    the keys users never set (still accepted, only not shown)."""
    keys = {}
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(f.default_factory if callable(f.default_factory) else None):
            cls = f.default_factory
            docs = field_docs(cls)
            for sub in dataclasses.fields(cls):
                keys[f"{f.name}.{sub.name}"] = (f.name, docs.get(sub.name, ""))
        else:
            keys[f.name] = ("", field_docs(Config).get(f.name, ""))
    return {k: v for k, v in keys.items() if hidden or k not in HIDDEN}


def presets() -> dict[str, list[str]]:
    """{config group: its preset names}, read from configs/ (``schema`` is internal)."""
    groups = {}
    for group in ("model", "data", "optim", "trainer", "experiment"):
        names = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
        groups[group] = [n for n in names if n != "schema"]
    return groups


def unknown_key(argv: list[str]) -> str | None:
    """One line for the first override in ``argv`` naming no key of the schema, else None.

    Group choices (``model=gpt_125m``), Hydra's own keys and flags are left to Hydra.
    """
    keys, groups = schema_keys(hidden=True), presets()
    skip_next = False
    for arg in argv:
        if skip_next or arg.startswith("-"):
            skip_next = arg in _VALUE_FLAGS
            continue
        key = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if key.startswith("hydra") or key in groups or key in keys:
            continue
        if any(key.startswith(k + ".") for k in keys):  # an element of a list or dict key
            continue
        shown = [k for k in keys if k not in HIDDEN]
        near = difflib.get_close_matches(key, shown, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        return (
            f"unknown key {key!r}{hint} (python -m engine.pretrain --help lists every key "
            "with its default)"
        )
    return None


def help_text(cfg: Config) -> str:
    """Every key with its value in ``cfg`` (the composed defaults) and its doc, by section."""
    lines = [
        "python -m engine.pretrain [KEY=VALUE ...] [GROUP=PRESET ...]  (-m KEY=A,B sweeps)",
        "",
        "Presets:",
    ]
    lines += [f"  {group}={'|'.join(names)}" for group, names in presets().items() if names]
    section_docs = {
        f.name: inspect.getdoc(f.default_factory).splitlines()[0]
        for f in dataclasses.fields(Config)
        if callable(f.default_factory) and dataclasses.is_dataclass(f.default_factory)
    }
    current = None
    for key, (section, doc) in schema_keys().items():
        if section != current:
            current = section
            title = f"{section}: {section_docs[section]}" if section else "run:"
            lines += ["", title]
        node = getattr(cfg, section) if section else cfg
        value = getattr(node, key.rsplit(".", 1)[-1])
        lines.append(f"  {key}={_show(value)}  # {doc}")
    lines += ["", "Hydra's own options: --hydra-help"]
    return "\n".join(lines)


def _show(value: object) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    return str(value)
