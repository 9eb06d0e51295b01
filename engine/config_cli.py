"""The command line of ``python -m engine.pretrain`` around Hydra: its ``--help``, and
overrides naming keys that do not exist.

Hydra's own ``--help`` dumps the composed config with its internal ``schema`` options, and
for a mistyped key it suggests appending it (``+trainer.max_step=``), which is the wrong
fix. Here every key of the schema (engine/config.py) is listed with its default and its
one-line doc, grouped by section, and an unknown key is refused with the nearest real one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from engine.config import SHORT_FORMS, Config
from engine.models.config import ModelConfig, preset, preset_names
from parallel_state.launcher import launch_env_problem

# Keys a user never sets: the run directory is Hydra's, the fault injection a test hook.
HIDDEN = {"run_dir", "trainer.fail_at_step"}
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Hydra's flags that take the next argument as their value.
# Hydra's own flags that take a value (``--cfg job``, ``--package model``, ``--info
# searchpath``): that value is no override to check.
_VALUE_FLAGS = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"}
_VALUE_FLAGS |= {"-c", "--cfg", "-p", "--package", "-i", "--info", "--experimental-rerun"}
_FIELD_DOC = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")
_BARE_FIELD = re.compile(r"^\s+(\w+)\s*:[^#=]+=[^#]+$")  # documented by the comment above


def field_docs(cls: type) -> dict[str, str]:
    """{field: its one-line doc}, the comment after each field of the dataclass ``cls``,
    or the comment lines just above a field that has none after it."""
    return dict(_source_docs(cls))


@functools.cache
def _source_docs(cls: type) -> tuple[tuple[str, str], ...]:
    """field_docs' pairs, read from the source once per class and process: every command
    line is checked against every key's doc, and inspect.getsource scans the module's
    whole source again on each call."""
    docs, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        match = _FIELD_DOC.match(line)
        if match:
            docs[match.group(1)] = match.group(2).strip()
        elif above and (bare := _BARE_FIELD.match(line)):
            docs[bare.group(1)] = " ".join(above)
        above = above + [line.strip()[1:].strip()] if line.strip().startswith("#") else []
    return tuple(docs.items())


def schema_keys(
    schema: type = Config, *, hidden: bool = False, docs: bool = True
) -> dict[str, tuple[str, str]]:
    """{dotted key: (section, doc)} of every key of ``schema``, in its order; ``hidden``:
    with the keys users never set (still accepted, only not shown). ``docs=False`` leaves
    the docs empty: reading them parses the schema's source, which checking a command
    line (every rank's start) does not need."""

    def docs_of(cls: type) -> dict[str, str]:
        return field_docs(cls) if docs else {}

    keys, top = {}, None
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory if callable(f.default_factory) else None):
            cls = f.default_factory
            section = docs_of(cls)
            for sub in dataclasses.fields(cls):
                keys[f"{f.name}.{sub.name}"] = (f.name, section.get(sub.name, ""))
        else:
            top = docs_of(schema) if top is None else top
            keys[f.name] = ("", top.get(f.name, ""))
    return {k: v for k, v in keys.items() if hidden or k not in HIDDEN}


def presets() -> dict[str, list[str]]:
    """{config group: its preset names}, read from configs/ (``schema`` is internal)."""
    groups = {}
    for group in ("model", "data", "optim", "trainer", "parallel", "experiment"):
        names = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
        groups[group] = [n for n in names if n != "schema"]
    return groups


def unknown_key(
    argv: list[str], schema: type = Config, prog: str = "engine.pretrain"
) -> str | None:
    """One line for the first override in ``argv`` naming no key of ``schema``, else None.

    A group choice (``model=gpt_125m``) must name a preset of configs/ unless a
    ``hydra.searchpath`` adds other folders; Hydra's own keys and flags are left to Hydra.
    """
    keys = schema_keys(schema, hidden=True, docs=False)
    groups = presets() if schema is Config else {}
    searched = any(a.split("=", 1)[0].lstrip("+~") == "hydra.searchpath" for a in argv)
    skip_next = False
    for arg in argv:
        if skip_next or arg.startswith("-"):
            skip_next = arg in _VALUE_FLAGS
            continue
        key = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if key in groups and "=" in arg and not searched:
            given = arg.split("=", 1)[1]
            # a sweep's list (-m model=a,b) names each; Hydra's sweep functions are its own
            for value in [] if "(" in given else given.split(","):
                if value not in groups[key]:
                    near = difflib.get_close_matches(value, groups[key], n=1, cutoff=0.6)
                    hint = f"; did you mean {key}={near[0]}?" if near else ""
                    return (
                        f"{key}={value} names no {key} preset{hint} (presets: "
                        f"{' '.join(groups[key])}; python -m {prog} --help lists them)"
                    )
            continue
        if key.startswith("hydra") or key in groups or key in keys:
            continue
        if any(key.startswith(k + ".") for k in keys):  # an element of a list or dict key
            continue
        shown = [k for k in keys if k not in HIDDEN]
        near = difflib.get_close_matches(key, shown, n=1, cutoff=0.8)
        hint = f"; did you mean {near[0]}?" if near else ""
        return f"unknown key {key!r}{hint} (python -m {prog} --help lists every key)"
    return None


def short_form_conflict(argv: list[str]) -> str | None:
    """One line when ``argv`` gives a size in both spellings with different values
    (``tp_size=2 parallel.tp=4``), naming both keys; else None."""
    given = {}
    for arg in argv:
        if "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            given[key.lstrip("+~")] = value.strip()
    for short, axis in SHORT_FORMS.items():
        values = given.get(short), given.get(f"parallel.{axis}")
        if None not in values and _as_size(values[0]) != _as_size(values[1]):
            return (
                f"{short}={values[0]} and parallel.{axis}={values[1]} disagree: {short} is "
                f"short for parallel.{axis}; give one of them"
            )
    return None


def _as_size(value: str) -> int | str:
    """A size as written on the command line, compared by value (``02`` is ``2``)."""
    try:
        return int(value)
    except ValueError:
        return value


def run_dir_problem(argv: list[str], default: str = "outputs") -> str | None:
    """Why Hydra could not create the run directory ``hydra.run.dir`` given in ``argv``
    (else ``default``), or None; checked without creating anything."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    target = Path(given[-1] if given else default)
    while not target.exists() and target != target.parent and not target.is_symlink():
        target = target.parent
    if target.exists() and not target.is_dir():
        return f"cannot create the run directory: {target} is a file (pass hydra.run.dir=DIR)"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"cannot create the run directory: {target} is not writable (pass hydra.run.dir=DIR)"
    return None


def fail_config(problems: list[str]) -> NoReturn:
    """Print each problem as one ``config error:`` line and exit 2. Under an outside
    launcher (torchrun, srun, mpirun) every rank checks the same config, so only the first
    rank of each node prints (three ranks gave three copies); the others exit 2 quietly."""
    from parallel_state.launcher import detect_launch

    try:
        speaks = detect_launch().local_rank == 0
    except ValueError:  # a launcher variable that is no number: every rank says so
        speaks = True
    if speaks:
        for line in problems:
            print(f"config error: {line}", file=sys.stderr)
    raise SystemExit(2)


def hydra_error_line(err: BaseException) -> str:
    """Hydra's message and its cause's (OmegaConf's, naming the key), as one line."""
    override = getattr(err, "override", None)  # set on Hydra's override parse errors
    parts = [f"cannot parse the override {override!r}:"] if override else []
    for e in (err, err.__cause__):
        for line in str(e or "").split("Config search path")[0].splitlines():
            skip = ("object_type=", "reference_type=", "See https://hydra.cc")
            if line.strip() and not line.strip().startswith(skip):
                parts.append(line.strip())
    return " ".join(dict.fromkeys(parts)) or type(err).__name__


@contextlib.contextmanager
def hydra_errors_as_one_line(fail: Callable[[list[str]], None]) -> Iterator[None]:
    """Inside, Hydra raises its override and composition errors (HYDRA_FULL_ERROR, for this
    process only) instead of printing them over several lines with exit 1; each becomes
    ``fail([line])``, as every other configuration error. So does an OSError of Hydra
    creating its run directory past :func:`run_dir_problem`."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (HydraException, OmegaConfBaseException) as err:
        fail([hydra_error_line(err)])
    except OSError as err:
        why = f"{err.filename}: {err.strerror or err}"
        fail([f"cannot create the run directory: {why} (pass hydra.run.dir=DIR)"])
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def help_text(cfg: Config) -> str:
    """Every key with its value in ``cfg`` (the composed defaults) and its doc, by section."""
    lines = [
        "python -m engine.pretrain [KEY=VALUE ...] [GROUP=PRESET ...]  (-m KEY=A,B sweeps)",
        "",
        "Presets:",
    ]
    lines += [f"  {group}={'|'.join(names)}" for group, names in presets().items() if names]
    section_docs = {  # a docstring's first paragraph, whole (its first line can stop mid-way)
        f.name: " ".join(inspect.getdoc(f.default_factory).split("\n\n")[0].split())
        for f in dataclasses.fields(Config)
        if callable(f.default_factory) and dataclasses.is_dataclass(f.default_factory)
    }
    m = cfg.model  # the composed values, not the dataclass defaults (GPT-2 small)
    section_docs["model"] += (
        f" Values below: {m.arch} h={m.hidden_size} l={m.num_layers} heads={m.num_heads} "
        f"vocab={m.vocab_size}."
    )
    current = None
    for key, (section, doc) in schema_keys().items():
        if section != current:
            current = section
            title = f"{section}: {section_docs[section]}" if section else "run:"
            lines += ["", title]
        node = getattr(cfg, section) if section else cfg
        value = getattr(node, key.rsplit(".", 1)[-1])
        lines.append(f"  {key}={override_value(value)}  # {doc}")
    lines += ["", "Hydra's own options: --hydra-help"]
    return "\n".join(lines)


def override_value(value: object) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    return str(value)


def model_overrides(current: ModelConfig, saved: ModelConfig) -> str:
    """The fewest overrides that give ``saved``'s :data:`RESUME_FIXED` keys: on the
    ``current`` model, or on the preset that needs the fewest (``model=llama_tiny`` or
    ``model=llama_tiny model.layernorm_eps=1e-06``)."""

    def keys(changes) -> list[str]:
        return [f"model.{key}={override_value(old)}" for key, old, _ in changes]

    best = keys(current.resume_changes(saved))
    for name in preset_names():
        mine = [f"model={name}", *keys(preset(name).resume_changes(saved))]
        if len(mine) < len(best):
            best = mine
    return " ".join(best)


# A sweep of more jobs than this is checked job by job as each starts, not all up front.
SWEEP_CHECK_JOBS = 256


def compose_run_config(overrides: list[str]) -> Config:
    """The config ``engine.pretrain`` composes from ``overrides`` (``hydra.*`` ones aside),
    before any rank resolves it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from engine.config import register_configs

    register_configs()
    given = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=given))


def rule_problems(cfg: Config) -> list[str]:
    """The layout and config rules' lines (``engine.config.validate``) for ``cfg``."""
    from engine.config import parallel_dims, validate
    from parallel_state.dims import LayoutError

    try:
        return validate(cfg, parallel_dims(cfg, None))
    except LayoutError as err:
        return [str(err)]


def sweep_problems(argv: list[str]) -> list[str]:
    """Under ``-m``, one line per job of the sweep its config rules refuse, each naming the
    job (``job #0 (tp_size=3 dp_size=1): ...``), so that a refused job stops the sweep
    before any job runs rather than after the jobs before it. A job that cannot be
    composed here (``${hydra:...}`` in a value) is left to its own start."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except (HydraException, OmegaConfBaseException):
        return []  # Hydra's own parse error, said as one line when it runs
    if len(jobs) > SWEEP_CHECK_JOBS:
        return []
    swept_keys = {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}
    problems = []
    for number, job in enumerate(jobs):
        try:
            found = rule_problems(compose_run_config(job))
        except (HydraException, OmegaConfBaseException, ValueError, TypeError):
            continue
        swept = " ".join(o for o in job if o.split("=", 1)[0].lstrip("+~") in swept_keys)
        problems += [f"job #{number} ({swept}) of the sweep: {line}" for line in found[:1]]
    return problems


def run_checked(
    main: Callable[[], None],
    argv: list[str],
    fail: Callable[[list[str]], None],
    *,
    schema: type = Config,
    prog: str = "engine.pretrain",
    default_run_dir: str = "outputs",
) -> None:
    """Run the Hydra ``main`` of ``python -m prog`` once ``argv`` names only real keys and
    a usable run directory, its Hydra errors as one line (``fail``, exit 2)."""
    problem = unknown_key(argv, schema, prog) or run_dir_problem(argv, default_run_dir)
    problem = problem or launch_env_problem()
    if schema is Config:
        problem = problem or short_form_conflict(argv)
    if problem:
        fail([problem])
    with hydra_errors_as_one_line(fail):
        main()
