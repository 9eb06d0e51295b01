"""Count host syncs and dispatched ops of the step after backward (fp16 loss-scale check,
unscale, global grad norm, clipping), on CPU with torch.profiler.

    python tools/count_host_syncs.py [--layers 4]

A host sync is any read of a device value into Python (``.item()``, ``bool()``, ``float()``,
``.cpu()`` of a scalar), which the profiler records as ``aten::_local_scalar_dense``; on a
GPU each one stalls the CPU until the GPU has caught up. Ops are counted as the top-level
``aten::`` calls the step dispatches, a proxy for kernel launches on a GPU (a multi-tensor
``_foreach_`` op is one call there and a few launches, whatever the parameter count).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.data_parallel import DynamicLossScaler, clip_grads_, global_grad_norm  # noqa: E402
from engine.models import build_model, preset  # noqa: E402
from engine.tool_args import ArgumentParser, positive_int  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=4, help="layers of the tiny GPT")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    cfg = preset(
        "gpt_tiny",
        vocab_size=256,
        hidden_size=64,
        num_heads=4,
        num_layers=args.layers,
        max_positions=32,
    )
    model = build_model(cfg)
    params = [q for q in model.parameters() if q.requires_grad]
    scaler = DynamicLossScaler(2.0**16)
    tokens = torch.randint(0, 256, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()

    def after_backward() -> None:
        if not scaler.found_overflow(params):
            scaler.unscale_(params)
        clip_grads_(params, 1.0, global_grad_norm(params, None))

    after_backward()  # warm up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        after_backward()
    events = list(prof.events())
    names = collections.Counter(e.name for e in events)
    top = sum(
        e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        for e in events
    )
    print(
        f"{len(params)} parameters: host syncs {names['aten::_local_scalar_dense']}, "
        f"top-level aten ops {top}"
    )
    return 0


if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
