"""ParallelDims: the one validated layout value, against hand-derived layouts and errors.

Every expected number below is worked out by hand from the rules (world = tp × dp,
dp_size=auto = world ÷ tp, global batch = micro × dp × accumulation, a sequence split over
tp under sequence parallelism), not taken from the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.config import parallel_dims, validate
from parallel_state.dims import LayoutError, ParallelDims
from studies.verification.layouts import VerifySpec
from tests.test_engine import compose_config

# (tp, dp as given, world or None) -> dp resolved, world
VALID = [
    ((2, "auto", 8), 4),  # 8 ranks ÷ tp 2
    ((4, None, 4), 1),  # None is auto: 4 ÷ 4
    ((1, "auto", None), 1),  # no launcher yet: this process starts tp ranks itself
    ((2, "3", None), 3),  # a command line spells integers as strings
    ((2, 3, 6), 3),
    ((8, 2, 16), 2),
]


@pytest.mark.parametrize(("args", "dp"), VALID)
def test_valid_layouts_resolve_once(args, dp):
    tp, _, _ = args
    dims = ParallelDims.resolve(*args)
    assert (dims.tp, dims.dp, dims.world) == (tp, dp, tp * dp)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.dp = 1  # a value: nobody downstream re-resolves or edits it


# Each error: the whole message is one line, names the bad value and says what to do.
ERRORS = [
    (lambda: ParallelDims(0, 1), ["tp_size must be an integer >= 1, got 0", "set tp_size"]),
    (lambda: ParallelDims(2, -1), ["dp_size must be an integer >= 1, got -1", "dp_size=auto"]),
    (lambda: ParallelDims(2, True), ["dp_size must be an integer >= 1, got True"]),
    (
        lambda: ParallelDims(2, 1, sequence_parallel="yes"),
        ["sequence_parallel='yes' must be true or false"],
    ),
    (
        lambda: ParallelDims.resolve(2, "many"),
        ["dp_size='many' must be an integer or 'auto'", "set dp_size=N or dp_size=auto"],
    ),
    (
        lambda: ParallelDims.resolve(3, "auto", 4),
        [
            "world size 4 is not divisible by tp_size 3",
            "launch a multiple of 3 processes",
            "choose a tp_size dividing 4",
        ],
    ),
    (
        lambda: ParallelDims.resolve(2, 3, 4),
        ["tp_size × dp_size = 2 × 3 = 6 does not equal the world size 4", "launch 6 processes"],
    ),
    (
        lambda: ParallelDims(4, 1, sequence_parallel=True).check_seq_len(30),
        ["data.seq_len=30 is not divisible by tp_size=4", "choose a multiple of 4"],
    ),
    (
        lambda: ParallelDims(1, 3).check_batch(4),
        ["batch 4 is not divisible by dp_size 3", "choose a multiple of 3"],
    ),
    # 20 sequences with micro 2 on dp 4: 20 % (2 × 4) = 4, so no whole number of steps.
    (
        lambda: ParallelDims(2, 4).check_batch(20, 2),
        [
            "trainer.global_batch=20 is not a multiple of trainer.micro_batch × dp_size = 2 × 4 = 8",
            "set trainer.global_batch to a multiple of 8",
        ],
    ),
    (
        lambda: ParallelDims(4, 1).check_tp_divides("model.num_heads", 6),
        ["model.num_heads=6 is not divisible by tp_size=4"],
    ),
]


@pytest.mark.parametrize(("call", "fragments"), ERRORS)
def test_each_error_is_one_line_naming_value_and_fix(call, fragments):
    with pytest.raises(LayoutError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_rules_that_hold_raise_nothing():
    # 24 = micro 3 × dp 4 × 2 accumulation steps; seq 32 = 4 × 8 positions per TP rank.
    ParallelDims(4, 4).check_batch(24, 3)
    ParallelDims(4, 1, sequence_parallel=True).check_seq_len(32)
    ParallelDims(4, 1).check_seq_len(30)  # without sequence parallelism any length splits
    ParallelDims(1, 4).check_batch(8)
    ParallelDims(4, 1).check_tp_divides("model.num_heads", 12)


def test_config_validation_uses_the_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config("tp_size=2", "dp_size=auto", "model.sequence_parallel=true")
    dims = parallel_dims(cfg, 8)
    assert (dims.tp, dims.dp, dims.sequence_parallel, dims.zero1) == (2, 4, True, False)
    assert parallel_dims(cfg, None).dp == 1  # no launcher: tp ranks started here
    bad = compose_config(
        "tp_size=4", "dp_size=1", "model.sequence_parallel=true", "data.seq_len=30"
    )
    problems = validate(bad, parallel_dims(bad, None))
    assert [p for p in problems if "data.seq_len=30 is not divisible by tp_size=4" in p], problems


def test_launcher_world_mismatch_is_one_config_line(tmp_path, monkeypatch, capsys):
    from engine.pretrain import prepare

    monkeypatch.chdir(tmp_path)
    # As torchrun sets them for 6 processes, while the config asks for 2 × 2 = 4.
    env = {
        "RANK": "0",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "6",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        prepare(compose_config("tp_size=2", "dp_size=2"))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "config error: tp_size × dp_size = 2 × 2 = 4 does not equal the world size 6; "
        "launch 4 processes or change the sizes (dp_size=auto follows the world size)"
    ], lines


def test_verifier_checks_its_layout_with_the_same_value():
    spec = VerifySpec(tp_size=2, dp_size=2, sequence_parallel=True, seq_len=12, batch_size=4)
    assert spec.dims == ParallelDims(2, 2, sequence_parallel=True)
    spec.check()  # 12 = 2 × 6, 4 = 2 × 2: a layout that splits
    with pytest.raises(LayoutError, match="seq_len=13 is not divisible by tp_size=2"):
        dataclasses.replace(spec, seq_len=13).check()
    with pytest.raises(LayoutError, match="batch 6 is not divisible by dp_size 4"):
        VerifySpec(tp_size=1, dp_size=4, batch_size=6).check()


@pytest.mark.parametrize(
    ("tp", "dp", "pp", "cp"),
    [
        (1, 1, 1, 1),
        (2, 1, 1, 1),
        (1, 3, 1, 1),
        (2, 3, 1, 1),
        (4, 2, 1, 1),
        (2, 2, 2, 1),
        (1, 2, 4, 1),
        (1, 1, 1, 2),
        (2, 2, 1, 2),
        (2, 1, 2, 3),
    ],
)
def test_rank_formula_and_groups_match_the_torch_grid(tp, dp, pp, cp):
    """The one rank formula against an independent reference: torch's row-major grid
    ``arange(world).view(pp, dp, cp, tp)``, whose last-axis rows are the TP groups, the
    next fibres the CP groups, then the DP groups and outermost the pipeline groups."""
    import torch

    dims = ParallelDims(tp, dp, pp, cp=cp)
    grid = torch.arange(tp * dp * pp * cp).view(pp, dp, cp, tp)
    assert dims.sizes == {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    assert dims.rank_grid() == grid.tolist()

    def fibres(*axes: int) -> list[list[int]]:
        """The groups along grid dims ``axes`` (the rest fixed), in rank order."""
        rest = [d for d in range(4) if d not in axes]
        g = grid.permute(*rest, *axes).reshape(-1, math.prod(grid.shape[d] for d in axes))
        return sorted(g.sort(dim=1).values.tolist())

    assert dims.group_ranks("tp") == grid.reshape(-1, tp).tolist() == fibres(3)
    assert dims.group_ranks("cp") == fibres(2)
    assert dims.group_ranks("dp") == fibres(1)
    assert dims.group_ranks("pp") == fibres(0)
    # Composite groups: the ranks that differ only in those axes, in rank order.
    assert dims.group_ranks(("dp", "cp", "tp")) == grid.reshape(pp, dp * cp * tp).tolist()
    assert dims.group_ranks(("tp", "pp")) == fibres(0, 3)
    assert dims.size_of(("pp", "tp")) == pp * tp and dims.size_of("grad") == dp * cp
    # The cp ranks of a replica reduce gradients, average the loss and hold the same
    # checkpoint shards with the DP replicas; only DP splits the batch.
    for role in ("grad", "loss", "replica"):
        assert dims.group_ranks(role) == fibres(1, 2)
    assert dims.group_ranks("batch") == dims.group_ranks("dp")
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    rank = int(grid[p, d, c, t])
                    assert dims.rank_of(pp=p, dp=d, cp=c, tp=t) == rank
                    assert rank == ((p * dp + d) * cp + c) * tp + t
                    assert dims.coords_of(rank) == {"pp": p, "dp": d, "cp": c, "tp": t}
                    assert dims.rank_in_stage(rank) == grid[p].flatten().tolist().index(rank)


def test_dims_carry_sequence_parallel_and_the_dp_sharding_mode():
    assert ParallelDims(2, 2, sequence_parallel=True, dp_shard="optimizer").zero1
    assert ParallelDims(2, 2).dp_shard == "none"
    assert not ParallelDims(2, 2, dp_shard="full").zero1
    kept = ParallelDims.resolve(2, "auto", 4, sequence_parallel=True, zero1=True)
    assert (kept.dp, kept.sequence_parallel, kept.zero1, kept.dp_shard) == (
        2,
        True,
        True,
        "optimizer",
    )
    with pytest.raises(
        LayoutError, match="parallel.dp_shard='zero2' is not one of none, optimizer"
    ):
        ParallelDims(2, 2, dp_shard="zero2")
    with pytest.raises(LayoutError, match="contradicts parallel.dp_shard=full"):
        ParallelDims.resolve(2, 2, zero1=True, dp_shard="full")


def test_pipeline_stages_take_their_share_of_the_world():
    dims = ParallelDims.resolve(2, "auto", 16, pp=4)
    assert (dims.pp, dims.dp, dims.tp, dims.world) == (4, 2, 2, 16)
    with pytest.raises(
        LayoutError, match="world size 12 is not divisible by tp_size × pp_size = 8"
    ):
        ParallelDims.resolve(2, "auto", 12, pp=4)
    with pytest.raises(
        LayoutError, match="pp_size × dp_size × tp_size = 2 × 2 × 2 = 8 does not equal"
    ):
        ParallelDims.resolve(2, 2, 4, pp=2)
    with pytest.raises(LayoutError, match="pp_size must be an integer >= 1, got 0"):
        ParallelDims(1, 1, 0)


def test_an_unknown_axis_or_role_is_one_line_naming_both_lists():
    with pytest.raises(KeyError, match="'sp' is neither a mesh axis .* nor a role"):
        ParallelDims(2, 1).group_ranks("sp")


# The parallel: section and its short forms (tp_size=, dp_size=, pp_size=): one layout.
# (short forms, the section's keys, a launcher's world size: 4 = 1 × 4; 16 = 2 × 4 × 2 and
# 4 × 4 with dp=auto)
SPELLINGS = [
    (("tp_size=1", "dp_size=4"), ("parallel.tp=1", "parallel.dp=4"), 4),
    (
        ("tp_size=2", "dp_size=auto", "pp_size=2"),
        ("parallel.tp=2", "parallel.dp=auto", "parallel.pp=2"),
        16,
    ),
    (
        ("tp_size=4", "experiment=gpt_125m_bf16"),
        ("parallel.tp=4", "experiment=gpt_125m_bf16"),
        16,
    ),
]


@pytest.mark.parametrize(("short", "section", "world"), SPELLINGS)
def test_short_forms_and_the_section_give_the_same_dims(
    tmp_path, monkeypatch, short, section, world
):
    monkeypatch.chdir(tmp_path)
    a, b = compose_config(*short), compose_config(*section)
    for launched in (None, world):
        assert parallel_dims(a, launched) == parallel_dims(b, launched)
    # Both spellings read the same sizes afterwards, whichever was given.
    assert (a.tp_size, a.dp_size, a.pp_size) == (a.parallel.tp, a.parallel.dp, a.parallel.pp)
    assert (b.tp_size, b.dp_size, b.pp_size) == (b.parallel.tp, b.parallel.dp, b.parallel.pp)


def test_a_short_form_overrides_a_preset_and_replace_keeps_the_spellings_together(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config("experiment=gpt_tiny_cpu1", "tp_size=2")  # the preset says tp 1
    assert parallel_dims(cfg, None) == ParallelDims(2, 1)
    wider = dataclasses.replace(cfg, dp_size=4)  # as prepare() resolves dp_size=auto
    assert (wider.parallel.dp, wider.dp_size, cfg.parallel.dp) == (4, 4, 1)


def test_both_spellings_with_different_values_are_one_line_naming_both_keys():
    from engine.config_cli import run_checked

    def main():
        raise AssertionError("a refused command line must not run")

    failed = []
    with pytest.raises(SystemExit):
        run_checked(main, ["tp_size=2", "parallel.tp=4"], lambda lines: _exit(failed, lines))
    assert len(failed) == 1 and "\n" not in failed[0], failed
    assert "tp_size=2" in failed[0] and "parallel.tp=4" in failed[0], failed
    ran = []
    run_checked(lambda: ran.append(1), ["dp_size=2", "parallel.dp=2"], failed.append)
    assert ran == [1]  # the same value twice is no conflict


def _exit(failed: list[str], lines: list[str]) -> None:
    failed.extend(lines)
    raise SystemExit(2)


def test_legacy_zero1_spelling_resolves_as_dp_shard_optimizer(tmp_path, monkeypatch):
    from engine.preflight import estimate_rank_bytes
    from parallel_state.dims import resolve_dp_shard

    monkeypatch.chdir(tmp_path)
    legacy = compose_config("optim.distributed=true", "dp_size=auto")
    current = compose_config("parallel.dp_shard=optimizer", "dp_size=auto")
    assert parallel_dims(legacy, 8) == parallel_dims(current, 8)
    assert parallel_dims(legacy, 8).dp_shard == "optimizer"
    # The memory estimate reads the mode through the same function.
    sizes = [estimate_rank_bytes(c, 4, fp32_activations=True) for c in (legacy, current)]
    assert sizes[0] == sizes[1]
    assert resolve_dp_shard("none", True) == resolve_dp_shard("optimizer", False) == "optimizer"
    with pytest.raises(LayoutError, match="contradicts parallel.dp_shard=gradients"):
        resolve_dp_shard("gradients", True)


def test_sequence_parallelism_and_the_schedule_are_in_the_section_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    section = compose_config(
        "tp_size=2", "dp_size=1", "parallel.sequence_parallel=true", "pp_size=2"
    )
    model_key = compose_config(
        "tp_size=2", "dp_size=1", "model.sequence_parallel=true", "pp_size=2"
    )
    for cfg in (section, model_key):  # either spelling: the layout and the layers agree
        assert parallel_dims(cfg, None) == ParallelDims(2, 1, 2, sequence_parallel=True)
        assert cfg.model.sequence_parallel and cfg.parallel.sequence_parallel
    assert not compose_config("tp_size=2").parallel.sequence_parallel
    gpipe = compose_config("pp_size=2", "parallel.schedule=gpipe")
    assert (gpipe.pipeline.schedule, gpipe.parallel.schedule) == ("gpipe", "gpipe")
    old = compose_config("pp_size=2", "pipeline.schedule=gpipe")  # the pipeline section's key
    assert (old.pipeline.schedule, old.parallel.schedule) == ("gpipe", "gpipe")
    assert compose_config("pp_size=2").parallel.schedule == "1f1b"


def test_a_group_is_named_by_its_axes_with_more_than_one_rank():
    """What a user reads in a watchdog line: the gradient role (dp × cp) is "dp" at cp 1,
    "dp and cp" at cp 2, and its first axis where no axis has two ranks."""
    assert ParallelDims(2, 2).live_axes("grad") == ["dp"]
    assert ParallelDims(1, 2, cp=2).live_axes("grad") == ["dp", "cp"]
    assert ParallelDims(2, 1, cp=2).live_axes("tp", "grad") == ["tp", "cp"]
    assert ParallelDims(1, 1).live_axes("grad") == ["dp"]


def _mesh_line(sequence_parallel: bool, tp: int) -> str:
    """The run's mesh line on this rank of a ``tp``-rank mesh (a collective)."""
    import parallel_state
    from engine.mesh_report import describe_mesh

    dims = ParallelDims(tp, 1, sequence_parallel=sequence_parallel)
    with parallel_state.initialize(dims, backend="gloo") as ps:
        return describe_mesh(ps)


@pytest.mark.slow  # starts gloo ranks
@pytest.mark.parametrize(("tp", "sp"), [(1, True), (1, False), (2, True)])
def test_the_mesh_line_says_when_sequence_parallelism_has_nothing_to_split(tp, sp):
    """SP at tp 1 is accepted (a sweep over tp sizes with SP on includes it) but does
    nothing: the mesh line says so, and only there."""
    from tests.multiproc import run_ranks

    line = run_ranks(_mesh_line, tp, sp, tp)[0]
    note = "(sequence_parallel: nothing to split at tp=1)"
    assert line.endswith(note) == (tp == 1 and sp), line
    assert line.startswith(f"mesh: tp groups [{list(range(tp))}]"), line
