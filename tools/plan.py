"""Plan a pipeline × data × context × tensor parallel run of a GPT or Llama-family model
(dense, or mixture-of-experts with expert parallelism): predict one layout or search them all.

    python tools/plan.py predict --model gpt_1.3b --global-batch 512 --gpus 16 --tp 2 --cluster dgx_h100
    python tools/plan.py search --model gpt_1.3b --global-batch 512 --gpus 16 --cluster dgx_h100
    python tools/plan.py search --model gpt_13b --global-batch 512 --gpus 8 --dp-shard full
    python tools/plan.py predict --model llama_70b --seq 4096 --global-batch 256 --gpus 32 \\
        --pp 4 --tp 4 --dp-shard full --schedule interleaved_1f1b --virtual-stages 4 --sequence-parallel
    python tools/plan.py predict --hidden 4096 --layers 32 --heads 32 --vocab 50257 --seq 2048 \\
        --global-batch 1024 --gpus 128 --tp 4 --recompute selective --sequence-parallel --zero1 --json
    python tools/plan.py predict --model llama_70b --seq 131072 --global-batch 64 --gpus 512 \
        --pp 4 --tp 8 --cp 8 --sequence-parallel --dp-shard optimizer --recompute full
    python tools/plan.py search --model llama_8b --seq 4096 --global-batch 512 --gpus 64 \
        --experts 8 --top-k 2 --moe-ffn 14336 --ep 8 --pp 1

Pure Python (no torch): the model is studies/perfmodel, the formulas and their validation
are in docs/PERFMODEL.md.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.perfmodel.plan_cli import build_parser, main  # noqa: E402


def parse_args(argv: list[str] | None = None):
    """The command line (the README test parses every command shown with it)."""
    return build_parser().parse_args(argv)


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
