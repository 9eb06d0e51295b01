"""What the families' Hugging Face maps share: the two tables a family declares (config keys,
weight names with their layout change) and the functions that read them in each direction,
plus per-group row interleaving and GeLU spellings.

A family's ``hf.py`` states its map once, as ``ConfigKey`` and ``Weights`` rows; import and
export both walk those rows, so the two directions cannot drift apart.
"""

from __future__ import annotations

import re
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from einops import rearrange
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import parallel_state

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

# config.json activation names → ModelConfig.activation
GELU_NAMES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def activation_from_hf(name: str) -> str:
    """``ModelConfig.activation`` of an HF GeLU name; a one-line error for others."""
    if name not in GELU_NAMES:
        raise ValueError(f"activation {name!r} is not supported; use one of {sorted(GELU_NAMES)}")
    return GELU_NAMES[name]


def activation_to_hf(activation: str, original: str | None) -> str:
    """The HF name of ``activation``: the imported original's spelling when it means the
    same (``gelu_pytorch_tanh`` and ``gelu_new`` are one function), else the usual one."""
    if GELU_NAMES.get(original) == activation:
        return original
    return "gelu_new" if activation == "gelu_tanh" else "gelu"


REQUIRED = object()  # a ConfigKey default: config.json must have the key


@dataclass(frozen=True)
class ConfigKey:
    """One ``config.json`` key ``theirs`` ↔ one ModelConfig field ``ours``.

    Import reads ``theirs`` (``default`` when absent; a KeyError when REQUIRED) through
    ``to_ours``; export writes attribute ``export`` (default ``ours``: a derived property
    such as ``ffn_size`` where the field may be None) through ``to_hf``, which also gets
    the value the imported original held (None if none).
    """

    ours: str
    theirs: str
    default: Any = REQUIRED
    export: str | None = None
    to_ours: Callable[[Any], Any] | None = None
    to_hf: Callable[[Any, Any], Any] | None = None


# The sizes under transformers' usual names (BERT, Llama, Mistral, Qwen2; GPT-2 has its own).
SIZE_KEYS = (
    ConfigKey("vocab_size", "vocab_size"),
    ConfigKey("hidden_size", "hidden_size"),
    ConfigKey("num_layers", "num_hidden_layers"),
    ConfigKey("num_heads", "num_attention_heads"),
    ConfigKey("ffn_hidden_size", "intermediate_size", export="ffn_size"),
    ConfigKey("max_positions", "max_position_embeddings"),
)


def gelu_key(theirs: str, default: str) -> ConfigKey:
    """``ModelConfig.activation`` ↔ a GeLU name under key ``theirs`` (see ``GELU_NAMES``)."""
    return ConfigKey(
        "activation", theirs, default, to_ours=activation_from_hf, to_hf=activation_to_hf
    )


# What a config.json value of each Python type must be, in words and as a test. JSON has
# no int/float split beyond the literal, so a float field takes an integer too; true and
# false are never numbers.
_VALUE_KINDS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    bool: ("true or false", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
    dict: ("an object", lambda v: isinstance(v, dict)),
    type(None): ("null", lambda v: v is None),
}


def hf_value(
    hf: dict[str, Any],
    name: str,
    kinds: type | tuple[type, ...],
    default: Any = REQUIRED,
    *,
    prefix: str = "",
) -> Any:
    """``hf[name]`` (``default`` when absent; a KeyError when REQUIRED), checked to be of
    one of ``kinds`` (int, float, bool, str, dict, NoneType): a one-line ValueError naming
    the key (after ``prefix``, the object ``hf`` sits in, e.g. ``rope_parameters.``) and
    what it must be otherwise (a list where a number belongs, a string...)."""
    value = hf[name] if default is REQUIRED else hf.get(name, default)
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if not any(_VALUE_KINDS[kind][1](value) for kind in kinds):
        wanted = " or ".join(_VALUE_KINDS[kind][0] for kind in kinds)
        raise ValueError(f"config.json {prefix}{name}={shown}: expected {wanted}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:  # torch sizes are int64
        raise ValueError(f"config.json {prefix}{name}={shown}: out of the 64-bit integer range")
    return value


def _field_kinds(field: str) -> tuple[type, ...]:
    """The Python types ModelConfig's annotation allows for ``field`` (``int | None``:
    int and NoneType), so the HF value is checked against the field it fills."""
    from engine.models.config import ModelConfig  # the config imports the families' table

    hint = typing.get_type_hints(ModelConfig)[field]
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def config_values(
    hf: dict[str, Any], keys: Sequence[ConfigKey], prefix: str = ""
) -> dict[str, Any]:
    """ModelConfig fields read from ``config.json`` dict ``hf`` through ``keys``, in order,
    each value first checked against its ModelConfig field's type (:func:`hf_value`;
    ``prefix`` names the object ``hf`` sits in, e.g. ``rope_parameters.``)."""
    values = {}
    for key in keys:
        value = hf_value(hf, key.theirs, _field_kinds(key.ours), key.default, prefix=prefix)
        values[key.ours] = key.to_ours(value) if key.to_ours else value
    return values


def validated(cfg: ModelConfig, keys: Sequence[ConfigKey]) -> ModelConfig:
    """``cfg`` once ``ModelConfig.validate`` (at TP 1) accepts it; its one-line error gains
    the ``config.json`` keys (through ``keys``) of the fields it names."""
    try:
        cfg.validate()
    except ValueError as err:
        theirs = {f"model.{key.ours}": key.theirs for key in keys}
        named = dict.fromkeys(theirs[f] for f in re.findall(r"model\.\w+", str(err)) if f in theirs)
        where = f" (config.json {', '.join(named)})" if named else ""
        raise ValueError(f"{err}{where}") from None
    return cfg


def config_json(
    cfg: ModelConfig,
    keys: Sequence[ConfigKey],
    base: dict[str, Any] | None,
    model_type: str,
    architectures: dict[str, str],
) -> dict[str, Any]:
    """``config.json`` of ``cfg`` through ``keys``, on top of ``base`` (the imported
    original, if any), naming ``model_type`` and its transformers class."""
    out = dict(base or {})
    out.update(architectures=[architectures[model_type]], model_type=model_type)
    out.update(config_items(cfg, keys, out))
    return out


def config_items(
    cfg: ModelConfig, keys: Sequence[ConfigKey], original: dict[str, Any]
) -> dict[str, Any]:
    """The ``config.json`` entries ``keys`` write for ``cfg`` (``original``: the imported
    values, which a key's ``to_hf`` may keep)."""
    items = {}
    for key in keys:
        value = getattr(cfg, key.export or key.ours)
        items[key.theirs] = key.to_hf(value, original.get(key.theirs)) if key.to_hf else value
    return items


@dataclass(frozen=True)
class Transform:
    """HF tensors → meshtron tensors (``to_ours``) and its inverse (``to_hf``); each takes
    the tensors positionally and returns a tuple. Pure permutations, so round trips are
    bitwise."""

    to_ours: Callable[..., tuple[torch.Tensor, ...]]
    to_hf: Callable[..., tuple[torch.Tensor, ...]]


SAME = Transform(lambda *tensors: tensors, lambda *tensors: tensors)
# Conv1D [in, out] ↔ nn.Linear [out, in]
TRANSPOSE = Transform(lambda w: (w.t(),), lambda w: (w.t(),))


def interleave_rows(parts: Sequence[torch.Tensor], groups: int | None) -> torch.Tensor:
    """Stack ``parts`` (each with rows ``(groups d)``) into rows ``(groups n d)``, so that
    each TP rank's contiguous slice holds whole groups (heads); ``groups`` None: every row
    is a group (d = 1)."""
    groups = groups or len(parts[0])
    return rearrange(torch.stack(list(parts)), "n (g d) ... -> (g n d) ...", g=groups)


def split_rows(fused: torch.Tensor, groups: int | None, n: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`interleave_rows`: the ``n`` parts, each with rows ``(groups d)``."""
    groups = groups or len(fused) // n
    return tuple(rearrange(fused, "(g n d) ... -> n (g d) ...", g=groups, n=n))


def interleaved(groups: int | None, n: int) -> Transform:
    """``n`` HF tensors ↔ one meshtron tensor with rows ``(groups n d)`` (``groups`` None:
    rows alternate, d = 1)."""
    return Transform(
        lambda *parts: (interleave_rows(parts, groups),),
        lambda fused: split_rows(fused, groups, n),
    )


@dataclass(frozen=True)
class Weights:
    """meshtron tensors ``ours`` ↔ HF tensors ``theirs`` through ``transform``. Names may
    hold ``{i}``, the layer index (see :func:`per_layer`)."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    transform: Transform = SAME


def weights(
    ours: str | Sequence[str],
    theirs: str | Sequence[str],
    transform: Transform = SAME,
    kinds: Iterable[str] = ("weight", "bias"),
) -> list[Weights]:
    """One ``Weights`` row per parameter kind: ``.weight`` and ``.bias`` (``kinds``)
    appended to every name."""
    ours, theirs = _names(ours), _names(theirs)
    return [
        Weights(tuple(f"{n}.{k}" for n in ours), tuple(f"{n}.{k}" for n in theirs), transform)
        for k in kinds
    ]


def rename(ours: str, theirs: str, transform: Transform = SAME) -> Weights:
    """One tensor under a new name (through ``transform``)."""
    return Weights((ours,), (theirs,), transform)


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def per_layer(rows: Sequence[Weights], num_layers: int) -> list[Weights]:
    """``rows`` for each layer in turn, ``{i}`` in their names filled in."""
    return [
        Weights(
            tuple(n.format(i=i) for n in row.ours),
            tuple(n.format(i=i) for n in row.theirs),
            row.transform,
        )
        for i in range(num_layers)
        for row in rows
    ]


def weight_map(
    cfg: ModelConfig,
    *,
    top: list[Weights],
    layer: list[Weights],
    head: Weights,
    fused: list[Weights],
) -> list[Weights]:
    """A family's rows in the order import reads them: ``top``, ``layer`` for each layer,
    the LM ``head`` unless tied to the embedding, then the ``fused`` rows for each layer."""
    n = cfg.num_layers
    untied = [] if cfg.tie_embeddings else [head]
    return top + per_layer(layer, n) + untied + per_layer(fused, n)


# The dtypes a meshtron model is built in (and so may be imported in).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _FactoriesOnMeta(TorchFunctionMode):
    """Every tensor factory (``torch.empty``, ``zeros``, ``arange``...) builds on the meta
    device, even one that names another device: ``with torch.device("meta")`` (the same
    mode over the same list of factories) only fills in a device left unnamed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def hf_shapes(
    cfg: ModelConfig, rows: Sequence[Weights], tp_group: dist.ProcessGroup | None = None
) -> dict[str, tuple[int, ...]]:
    """HF tensor name → the shape the meshtron model of ``cfg`` needs there: the model's own
    parameters, built without memory or communication at ``tp_group``'s size and taken at
    full shape, carried through the map's ``to_hf``."""
    # Imported here: build reads the family table this module's families feed, and the
    # checkpoint's full-shape rule (param_spec) imports the models.
    from engine.checkpoint.state import param_spec
    from engine.models.build import build_model

    # Layers draw their full master weights on CPU whatever the device (same values at
    # every TP size), so a "meta" build alone would allocate and fill the whole model in
    # fp32; under _FactoriesOnMeta every tensor the build makes is a meta one.
    # Nothing is drawn on meta: the default state's dropout RNG, which the build falls back
    # to (and warns of) without rng=, is never used.
    with _FactoriesOnMeta(), warnings.catch_warnings():
        warnings.simplefilter("ignore", parallel_state.ImplicitStateWarning)
        model = build_model(cfg, tp_group=tp_group, device="meta")
        full = {n: param_spec(n, p, "model", model).shape for n, p in model.named_parameters()}
    ours = {name: torch.empty(shape, device="meta") for name, shape in full.items()}
    return {name: tuple(t.shape) for name, t in state_to_hf(rows, ours).items()}


def check_tensors(hf: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """A one-line ValueError for the first tensor of ``hf`` that ``shapes`` (see
    :func:`hf_shapes`) places whose shape differs or whose dtype is not floating-point."""
    for name, shape in shapes.items():
        tensor = hf.get(name)
        if tensor is None:
            continue  # a missing tensor is state_from_hf's KeyError
        if tensor.dtype not in FLOAT_DTYPES:
            wanted = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
            raise ValueError(
                f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')}, expected a "
                f"floating-point one ({wanted})"
            )
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)}, expected {shape} for its config.json"
            )


def state_from_hf(
    cfg: ModelConfig,
    rows: Sequence[Weights],
    hf: dict[str, torch.Tensor],
    checkpoint: str,
    ignored: Callable[[str], bool],
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """meshtron state dict of ``cfg`` from HF state dict ``hf`` through ``rows``: a one-line
    KeyError naming the expected ``checkpoint`` for a missing tensor, a ValueError for a
    tensor of the wrong shape or dtype (:func:`check_tensors`; ``tp_group``: the group the
    caller builds its model over, if any), or one no row places unless ``ignored``
    (buffers, tied copies)."""
    check_tensors(hf, hf_shapes(cfg, rows, tp_group))
    used, ours = set(), {}
    try:
        for row in rows:
            converted = row.transform.to_ours(*(hf[name] for name in row.theirs))
            used.update(row.theirs)
            ours.update(zip(row.ours, converted, strict=True))
    except KeyError as missing:
        raise KeyError(f"HF weights lack {missing}; expected a {checkpoint} checkpoint") from None
    unused = [k for k in hf if k not in used and not ignored(k)]
    if unused:
        raise ValueError(f"HF weights meshtron does not know how to place: {unused[:5]}")
    return contiguous_copies(ours)


def state_to_hf(rows: Sequence[Weights], ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf`: HF state dict of meshtron state dict ``ours``."""
    hf = {}
    for row in rows:
        converted = row.transform.to_hf(*(ours[name] for name in row.ours))
        hf.update(zip(row.theirs, converted, strict=True))
    return contiguous_copies(hf)


StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StateMap:
    """A family's weight map, declared once and read both ways: ``rows(cfg)`` (its
    ``Weights`` rows), the ``checkpoint`` class an import's KeyError names, the HF keys that
    hold no parameter of their own (``ignored(cfg, key)``: buffers, tied copies) and what an
    import first does to the HF dict (``prepare``: e.g. a bare model's missing prefix)."""

    rows: Callable[[ModelConfig], list[Weights]]
    checkpoint: str
    ignored: Callable[[ModelConfig, str], bool]
    prepare: Callable[[ModelConfig, StateDict], StateDict] | None = None

    def state_from_hf(
        self, cfg: ModelConfig, hf: StateDict, *, tp_group: dist.ProcessGroup | None = None
    ) -> StateDict:
        """meshtron full state dict of ``cfg`` from HF state dict ``hf`` (see
        :func:`state_from_hf`)."""
        if self.prepare is not None:
            hf = self.prepare(cfg, hf)
        return state_from_hf(
            cfg,
            self.rows(cfg),
            hf,
            self.checkpoint,
            lambda key: self.ignored(cfg, key),
            tp_group=tp_group,
        )

    def state_to_hf(self, cfg: ModelConfig, ours: StateDict) -> StateDict:
        """Inverse of :meth:`state_from_hf` (a tied head omitted, as save_pretrained does)."""
        return state_to_hf(self.rows(cfg), ours)


def with_prefix(marker: str, prefix: str) -> Callable[[ModelConfig, StateDict], StateDict]:
    """A ``StateMap.prepare`` for a state dict saved from the bare model class (GPT2Model,
    Gemma2Model), known by its key ``marker``: every key gains the ``prefix`` it lacks."""

    def prepare(cfg: ModelConfig, hf: StateDict) -> StateDict:
        return {f"{prefix}{k}": v for k, v in hf.items()} if marker in hf else hf

    return prepare


def contiguous_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor copied into its own contiguous storage (no views of the input left)."""
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in state.items()}
