"""The MoE benchmark (studies/bench/moe.py, tools/bench_moe.py) at tiny sizes: its tables
have their rows, and meshtron's layer agrees with transformers' Mixtral block on the
weights it copied. No timing is asserted (a shared machine's times say nothing here)."""

from __future__ import annotations

import json

import pytest
import torch

import studies.verification.moe_blocks as moe_blocks
from studies.bench import moe as bench

TINY = ["--experts", "4", "--hidden", "32", "--ffn", "16", "--tokens", "64"]
ONE_STEP = ["--repeats", "1", "--warmup", "0"]
LAYER_ROWS = ("| meshtron MoEMLP (", "| transformers eager |", "| transformers grouped_mm |")


def _run(tmp_path, capsys, *argv) -> tuple[str, dict]:
    path = tmp_path / "moe.json"
    assert bench.main([*TINY, *ONE_STEP, *argv, "--json", str(path)]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_layer_table_has_its_rows_and_meshtron_matches_transformers(tmp_path, capsys):
    out, got = _run(tmp_path, capsys, "--only", "layer")
    lines = out.splitlines()
    for row in LAYER_ROWS:
        assert sum(line.startswith(row) for line in lines) == 1, out
    # h = 32 and 16 are 16-byte multiples in fp32: grouped_mm_fits takes torch._grouped_mm.
    assert "meshtron MoEMLP (torch._grouped_mm)" in out
    layer = got["layer"]
    assert [r["layer"] for r in layer["rows"]] == [
        "meshtron",
        "transformers eager",
        "transformers grouped_mm",
    ]
    # fp32, the same weights, tokens and routing (both routers softmax in fp32 on the same
    # logits): the layers differ only in the order of their sums (grouped rows summed per
    # token against a per-expert loop with index_add), a few fp32 ulps (~1e-7 each) of
    # outputs ~1; a wrong weight, layout or permutation moves them by O(0.1).
    for row in layer["rows"]:
        assert row["max_abs_diff"] <= 1e-5, row
    assert layer["out_max_abs"] > 0.3  # outputs O(1): the tolerance above is meaningful


def test_a_wrong_weight_layout_shows_in_the_difference(tmp_path, capsys, monkeypatch):
    """The check above can fail: fc1's gate and up columns left concatenated instead of
    interleaved (the layout transformers uses, not ours) move the outputs far."""
    right = moe_blocks.block_to_ours

    def concatenated(hf):
        ours = right(hf)
        ours["experts.fc1"] = hf["experts.gate_up_proj"].transpose(1, 2)
        return ours

    monkeypatch.setattr(moe_blocks, "block_to_ours", concatenated)
    _, got = _run(tmp_path, capsys, "--only", "layer")
    assert min(r["max_abs_diff"] for r in got["layer"]["rows"][1:]) > 1e-2


@pytest.mark.slow
def test_ep_table_has_both_layouts_and_ep_2_matches_ep_1(tmp_path, capsys):
    out, got = _run(tmp_path, capsys, "--only", "ep")
    lines = out.splitlines()
    for row in ("| ep 1 |", "| ep 2 |"):
        assert sum(line.startswith(row) for line in lines) == 1, out
    ep = got["ep"]
    # fp32, rank 0's tokens: at ep 2 an expert's rows from both ranks go through one
    # grouped GEMM (each row's own dot products unchanged), so only summation order can
    # differ: the same bound as against transformers.
    assert ep["max_abs_diff"] <= 1e-5
    assert ep["rows"][1]["a2a_ms"] > 0  # the ep 2 step did run all-to-alls
    assert torch.isfinite(torch.tensor([r["ms"] for r in ep["rows"]])).all()
