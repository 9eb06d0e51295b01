"""GPT and BERT at every (tp, dp, sequence-parallel, recompute) layout match the unsplit model.

Each layout is compared by ``studies.verification.layouts.compare_layouts`` against tp=1,
dp=1 on the same seed and global batch: every module output, the loss and every parameter
gradient, all gathered to full shape. Tolerances are relative to max |reference|
(``layouts.TOLERANCES``):
float64 1e-10 — layouts differ only in the order of floating-point sums, which leaves
errors near 1e-15, so 1e-10 proves the math while any real mistake shows up as O(1);
float32 1e-5 — unit roundoff 6e-8 times a few dozen reordered reductions; bfloat16 5e-2 —
LayerNorm gradients sum every token in a layout-dependent grouping, several roundoffs of
3.9e-3 apart (see the comment on ``layouts.TOLERANCES``).
"""

from __future__ import annotations

import re

import pytest
import torch

import parallel_state
from engine.checkpoint.format import load_model, read_checkpoint, save_model, write_checkpoint
from engine.models import ModelConfig, build_model, preset
from parallel_state import ImplicitStateWarning
from studies.verification.layouts import VerifySpec, compare_layouts, solo_group
from tests.multiproc import run_ranks
from tests.torch_reference import tiny_gpt


def _spec(model, tp, dp, sp=False, rc="none", dtype="float64", steps=1) -> VerifySpec:
    return VerifySpec(
        model=model,
        tp_size=tp,
        dp_size=dp,
        sequence_parallel=sp,
        recompute=rc,
        dtype=dtype,
        steps=steps,
    )


# Every factor (model, sequence parallelism, each recompute mode, dtype, several steps) is
# covered at several layouts. The suite keeps 18 of the 40 specs it ran before 2026-11-27
# (for its time): the full cross product at tp 2 and the other 22 are
# `tools/verify_equivalence.py` runs, reported in the closing notes.
LAYOUTS = {
    1: [_spec(m, 1, 1, rc=rc) for m, rc in (("gpt", "selective"), ("bert", "full"))]
    + [_spec("gpt", 1, 1, dtype="float32")],
    2: [
        _spec("gpt", 2, 1, False, "none"),
        _spec("gpt", 2, 1, True, "full"),
        _spec("bert", 2, 1, False, "full"),
        _spec("bert", 2, 1, True, "selective"),
        _spec("bert", 2, 1, True, "selective", "float32"),
        _spec("gpt", 2, 1, True, "none", steps=3),
    ],
    3: [
        _spec("gpt", 3, 1, True, "selective"),
        _spec("bert", 3, 1, True, "full"),
        _spec("gpt", 3, 1, True, "none", "float32"),
    ],
    4: [
        _spec("gpt", 4, 1, True, "selective"),
        _spec("gpt", 2, 2, True, "full"),
        _spec("bert", 2, 2, True, "none", steps=3),
        _spec("bert", 1, 4, False, "full"),
        _spec("gpt", 2, 2, True, "none", "float32"),
        _spec("bert", 2, 2, True, "selective", "bfloat16"),
    ],
}


def _equivalence(specs: list[VerifySpec]) -> list[tuple]:
    results = []
    for spec in specs:
        parallel_state.initialize(spec.tp_size, spec.dp_size)
        report = compare_layouts(spec)
        parallel_state.destroy()
        if report is not None:
            worst = {
                kind: max((r.max_rel for r in report.rows if r.kind == kind), default=0.0)
                for kind in ("output", "loss", "grad")
            }
            failure = report.first_failure
            results.append((spec, worst, None if failure is None else (failure.kind, failure.name)))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_match_unsplit_model(world_size):
    results = run_ranks(_equivalence, world_size, LAYOUTS[world_size], timeout=300)[0]
    for spec, worst, _ in results:
        print(
            f"{spec.model:4s} tp={spec.tp_size} dp={spec.dp_size} sp={spec.sequence_parallel!s:5s} "
            f"recompute={spec.recompute:9s} {spec.dtype:8s} steps={spec.steps}: max rel "
            f"output {worst['output']:.1e}  loss {worst['loss']:.1e}  grad {worst['grad']:.1e}"
        )
    failures = [(s, f) for s, _, f in results if f is not None]
    assert not failures, f"first diverging tensors: {failures}"
    assert len(results) == len(LAYOUTS[world_size])


def _weights_and_checkpoints(ckpt_dir: str, vocab_size: int) -> dict[str, bool]:
    ps = parallel_state.initialize(3, 1)
    solo, checks = solo_group(ps), {}
    for arch in ("gpt", "bert"):
        cfg = preset(f"{arch}_tiny", vocab_size=vocab_size, hidden_size=48, num_heads=6)
        ps.seed(7)
        model = build_model(cfg)  # vocab padded to 1152 at tp=3, 1024 at tp=1
        full = model.full_state_dict()
        save_model(model, f"{ckpt_dir}/{arch}-tp3")
        reference = None
        if ps.rank == 0:
            ps.seed(7)
            reference = build_model(cfg, tp_group=solo).full_state_dict()
            checks[f"{arch}: same full weights at tp=1 and tp=3"] = _equal(full, reference)
            stored = read_checkpoint(f"{ckpt_dir}/{arch}-tp3").state
            checks[f"{arch}: tp=3 checkpoint holds the full weights"] = _equal(stored, reference)
            loaded = load_model(f"{ckpt_dir}/{arch}-tp3", tp_group=solo).full_state_dict()
            checks[f"{arch}: tp=3 checkpoint loads at tp=1"] = _equal(loaded, reference)
            shifted = {k: v + 1 for k, v in reference.items()}
            write_checkpoint(f"{ckpt_dir}/{arch}-tp1", shifted, cfg)
        torch.distributed.barrier()
        resharded = load_model(f"{ckpt_dir}/{arch}-tp1").full_state_dict()
        if ps.rank == 0:
            checks[f"{arch}: tp=1 checkpoint loads at tp=3"] = _equal(resharded, shifted)
    return checks


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_same_seed_same_full_weights_and_checkpoints_reshard(tmp_path):
    # 1001 rows pad to 1152 at tp=3 but 1024 at tp=1: padding must not shift any RNG draw.
    checks = run_ranks(_weights_and_checkpoints, 3, str(tmp_path), 1001)[0]
    assert len(checks) == 8
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]


def test_config_validation_names_key_and_numbers():
    cases = {
        "model.num_heads=6 is not divisible by tp_size=4": (dict(num_heads=6, hidden_size=48), 4),
        "model.hidden_size=50 is not divisible by model.num_heads=4": (dict(hidden_size=50), 1),
        "model.ffn_hidden_size=100 is not divisible by tp_size=8": (
            dict(ffn_hidden_size=100, num_heads=8),
            8,
        ),
        "model.recompute='some'": (dict(recompute="some"), 1),
        "model.hidden_dropout=1.5": (dict(hidden_dropout=1.5), 1),
    }
    for message, (overrides, tp) in cases.items():
        base = dict(hidden_size=64, num_heads=4, num_layers=1) | overrides
        with pytest.raises(ValueError, match=re.escape(message)):
            ModelConfig(**base).validate(tp)
    preset("gpt_1.3b").validate(8)
    assert preset("bert_large").num_heads == 16 and preset("gpt_125m").vocab_size == 50257


def test_model_config_is_a_structured_config_schema():
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.structured(ModelConfig)
    node.ffn_hidden_size = 256  # Optional[int] field accepts ints and None
    node.ffn_hidden_size = None
    assert omegaconf.OmegaConf.to_object(node) == ModelConfig()


def _state_in_layers(implicit: bool) -> tuple[set[bool], list[str]]:
    import warnings

    ps = parallel_state.initialize(2, 1)
    ps.seed(11)
    cfg = tiny_gpt(
        64, num_layers=2, hidden_dropout=0.1, attention_dropout=0.1, recompute="selective"
    )
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(cfg) if implicit else build_model(cfg, ps)
        model(batch[:, :-1], batch[:, 1:]).mean().backward()
    handed = {model.tp_group is ps.tp_group} | {layer.rng is ps.rng for layer in model.layers}
    implicit_uses = [str(w.message) for w in caught if w.category is ImplicitStateWarning]
    return handed, implicit_uses


@pytest.mark.slow
def test_build_model_hands_the_state_to_every_layer():
    """``build_model(cfg, state)``: every layer gets the state's TP group and RNG tracker
    (dropout and selective recompute on, so the tracker is really drawn from) and nothing
    reaches the default state; the short form still works but says it fell back."""
    for handed, implicit_uses in run_ranks(_state_in_layers, 2, False):
        assert handed == {True} and implicit_uses == []
    for handed, implicit_uses in run_ranks(_state_in_layers, 2, True):
        assert handed == {True}
        assert "tp_group was not passed" in implicit_uses[0]
        assert any("rng was not passed" in m for m in implicit_uses)


@pytest.mark.parametrize("name", ["gpt_tiny", "bert_tiny", "llama_tiny"])
def test_one_kernel_set_per_model(name):
    """``model.kernels`` is resolved once per model and handed down: every module that
    holds a kernel set holds the model's own (it used to be resolved 4L+2 times per GPT)."""
    from layers.kernel_set import Kernels

    model = build_model(preset(name, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2))
    holders = [m for m in model.modules() if isinstance(getattr(m, "kernels", None), Kernels)]
    assert len(holders) >= 2 * model.cfg.num_layers + 1  # layers, their MLPs and norms, ...
    assert {id(m.kernels) for m in holders} == {id(model.kernels)}


def test_every_family_is_a_folder_the_registry_reaches():
    """Each ``FAMILIES`` entry names a folder with the model class (of that arch), the HF
    map and the cost terms; the tiny preset's parameter count is the built model's; an
    unknown arch is one line naming the known ones, from the config and from build_model."""
    import ast
    from pathlib import Path

    from engine.hf_interop import config_from_hf, config_to_hf
    from engine.models import FAMILIES, ParallelModel

    for arch, fam in FAMILIES.items():
        cls = fam.model_class()
        assert issubclass(cls, ParallelModel) and arch == cls.ARCH
        hf_map = ("ARCHITECTURES", "config_from_hf", "config_to_hf", "state_from_hf", "state_to_hf")
        assert all(hasattr(fam.hf, name) for name in hf_map), arch
        assert hasattr(fam.costs, "model_flops") and hasattr(fam.costs, "params_count")
        cfg = preset(f"{arch}_tiny", vocab_size=64, hidden_size=32, num_heads=4, num_layers=2)
        state = build_model(cfg).full_state_dict()  # the vocabulary unpadded
        assert fam.costs.params_count(cfg) == sum(t.numel() for t in state.values())
        assert config_from_hf(config_to_hf(cfg)).arch == arch
    message = "model.arch='t5' is not one of ('gpt', 'bert', 'llama', 'gemma')"
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig(arch="t5").validate()
    with pytest.raises(ValueError, match=re.escape(message)):
        build_model(ModelConfig(arch="t5"))
    # The config reads the table, and every family imports the config: so the table
    # imports nothing of ours (the families' modules are imported when asked for).
    source = (Path(__file__).resolve().parents[1] / "engine/models/families.py").read_text()
    imported = [
        a.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in node.names
    ]
    assert not [m for m in imported if m.split(".")[0] in ("engine", "layers", "parallel_state")]
