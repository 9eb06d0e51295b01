"""What a mixture-of-experts run shows per logging window: each MoE layer's expert load,
dropped token-slots and router losses (the console's ``moe:`` line, TensorBoard's
``moe/layer{i}/*`` scalars and the metrics file's ``"moe"`` list).

The step runner hands every micro-batch's ``RouterLosses`` (``layers.moe.moe_losses``,
read right after the forward) to a :class:`MoEWindow`; nothing is synchronised until the
window closes at a log step. Then one all-reduce (a sum over the ``loss`` group: the
dp × cp ranks that route different tokens) makes every layer's figures those of the
whole global batch:

* tokens per expert: the token-slots the router chose for each expert (before any
  capacity drop; a token counts once for each of its k experts, so they sum to k · T), per
  step (the window's sum over steps ÷ its steps), summed over the ranks;
* load CV: the coefficient of variation of those counts over the E experts,
  std / mean with the population std (divided by E, not E − 1); 0 is a perfect balance;
* dropped: token-slots dropped past the capacity ÷ token-slots chosen (0 when dropless);
* aux, z: the mean of the router's unweighted load-balancing and z-losses over the
  window's micro-batch forwards and the ranks (each forward's value on its own tokens).

Under pipeline parallelism each stage's window holds its own MoE layers (each chunk's
forward adds its layers'); the close gathers them over the pipeline group, so the line
and the history cover the whole model on every rank.

The window also keeps each step's own slot counts: at the step's end they move the
sigmoid router's expert biases (DeepSeek-V3's auxiliary-loss-free balancing,
``TopKRouter.update_bias``) by the load of the whole global batch: summed over the step's
micro-batches and over the ``loss`` group (its dp × cp ranks route different tokens; TP
ranks route the same ones, so they are not counted twice), so every rank that routes with
a bias moves it alike. Under pp each stage moves its own routers' biases.

The console line aggregates the layers: aux, z and CV are means over layers, min and max
the extremes over layers and experts, dropped the fraction over all layers' slots.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from engine import comm
from layers.router import RouterLosses, TopKRouter


def router_layers(model: nn.Module) -> list[int]:
    """The layer number of each router of ``model`` in module order: the first integer in
    its module name (``layers.3.mlp.router`` → 3), else its position among the routers."""
    names = [name for name, m in model.named_modules() if isinstance(m, TopKRouter)]
    numbers = [re.search(r"(?:^|\.)(\d+)(?:\.|$)", name) for name in names]
    if all(numbers) and len({int(n.group(1)) for n in numbers}) == len(names):
        return [int(n.group(1)) for n in numbers]
    return list(range(len(names)))


class MoEWindow:
    """Each MoE layer's router statistics since the last log step (module docstring)."""

    def __init__(
        self, model: nn.Module, device: torch.device, *, pp_group: dist.ProcessGroup | None = None
    ) -> None:
        """``model``: this rank's part of the model; ``pp_group``: where the other
        stages' MoE layers are (a stage may hold none), gathered at each close."""
        self.layers = router_layers(model)
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.num_experts = routers[0].num_experts if routers else 0
        self.device, self.pp_group = device, pp_group
        self.history: list[dict] = []  # one entry per closed window, for the metrics file
        # The routers whose bias each step moves, by row (all of a model's, or none).
        self.biased = [(row, m) for row, m in enumerate(routers) if m.kind == "sigmoid"]
        shape = (len(routers), self.num_experts)
        self.step_slots = torch.zeros(shape, dtype=torch.int64, device=device)
        self._reset()

    def _reset(self) -> None:
        shape = (len(self.layers), self.num_experts)
        self.slots = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.dropped = torch.zeros(len(self.layers), dtype=torch.int64, device=self.device)
        self.losses = torch.zeros(len(self.layers), 2, dtype=torch.float64, device=self.device)
        self.forwards = self.steps = 0  # forwards: the add calls (a pipeline chunk's each)
        self.layer_forwards = [0] * len(self.layers)  # under pp a chunk adds its layers only

    def add(self, losses: list[RouterLosses], layers: list[int] | None = None) -> None:
        """One micro-batch forward's router statistics, layer by layer (no host sync):
        of every layer, or of the ``layers`` (their numbers) one pipeline chunk holds."""
        layers = self.layers if layers is None else layers
        if len(losses) != len(layers):
            raise ValueError(f"{len(losses)} router results for {len(layers)} MoE layers")
        rows = [self.layers.index(number) for number in layers]
        with torch.no_grad():
            slots = torch.stack([one.slots_per_expert for one in losses]).to(self.device)
            self.slots[rows] += slots
            self.step_slots[rows] += slots
            self.dropped[rows] += torch.stack([one.dropped for one in losses]).to(self.device)
            pairs = [torch.stack([one.aux.detach(), one.z.detach()]) for one in losses]
            self.losses[rows] += torch.stack(pairs).to(self.device, torch.float64)
        for row in rows:
            self.layer_forwards[row] += 1
        self.forwards += 1

    def end_step(self, group=None) -> None:
        """A step's micro-batches are all in: with sigmoid routers, their biases move by
        the step's load summed over ``group`` (the ``loss`` group; a collective, every rank
        of it calls this together; None: this rank's load alone)."""
        self.steps += 1
        if self.biased:
            load = self.step_slots.double()
            if group is not None:
                load = comm.sum_(load.to(comm.collective_device(group, self.device)), group)
            for row, router in self.biased:
                router.update_bias(load[row].to(self.device))
        self.step_slots.zero_()

    def close(self, group, step: int) -> list[dict[str, float]]:
        """Every layer's figures for the window (summed over ``group``, then under pp
        gathered over ``pp_group``: collectives, every rank of them calls this together),
        then a fresh window. Appends them to ``history``."""
        packed = torch.cat(
            [
                self.slots.double(),
                self.dropped.double().unsqueeze(1),
                self.losses,
                torch.tensor(self.layer_forwards, dtype=torch.float64, device=self.device)[:, None],
            ],
            dim=1,
        ).to(comm.collective_device(group, self.device), torch.float64)
        packed = comm.sum_(packed, group).cpu()
        steps = max(self.steps, 1)
        self._reset()
        layers = [layer_figures(row, self.num_experts, steps) for row in packed]
        for number, figures in zip(self.layers, layers, strict=True):
            figures["layer"] = number
        if self.pp_group is not None:  # every stage's layers, in layer order
            stages = comm.all_gather_object(layers, self.pp_group)
            layers = sorted((one for part in stages for one in part), key=lambda one: one["layer"])
        self.history.append({"step": step, "layers": layers})
        return layers


def load_cv(counts: torch.Tensor) -> float:
    """std / mean of ``counts`` over experts, population std (÷ E); 0 for no tokens."""
    counts = counts.double()
    mean = counts.mean()
    return 0.0 if mean == 0 else float(counts.std(correction=0) / mean)


def layer_figures(row: torch.Tensor, num_experts: int, steps: int) -> dict[str, float]:
    """One layer's packed sums (E slot counts, dropped, aux sum, z sum, forwards) → figures."""
    slots = row[:num_experts]
    dropped, aux, z, forwards = row[num_experts:].tolist()
    per_step = slots / steps
    chosen = float(slots.sum())
    return {
        "aux": aux / max(forwards, 1),
        "z": z / max(forwards, 1),
        "cv": load_cv(slots),
        "min_tokens": float(per_step.min()),
        "max_tokens": float(per_step.max()),
        "dropped": dropped / chosen if chosen else 0.0,
        "dropped_slots": dropped,
        "chosen_slots": chosen,
    }


def format_moe_line(layers: list[dict[str, float]]) -> str:
    """The console's MoE line for a window's layers (aggregated as the module says)."""
    n = len(layers)
    chosen = sum(one["chosen_slots"] for one in layers)
    dropped = sum(one["dropped_slots"] for one in layers) / chosen if chosen else 0.0
    return (
        f"moe: aux {sum(one['aux'] for one in layers) / n:.4f} "
        f"z {sum(one['z'] for one in layers) / n:.4f} "
        f"load cv {sum(one['cv'] for one in layers) / n:.2f} "
        f"(min {min(one['min_tokens'] for one in layers):.0f} "
        f"max {max(one['max_tokens'] for one in layers):.0f} tokens/expert) "
        f"dropped {100 * dropped:.1f}%"
    )


def moe_scalars(layers: list[dict[str, float]]) -> dict[str, float]:
    """TensorBoard's ``moe/layer{i}/{aux,z,cv,min_tokens,max_tokens,dropped}``."""
    keys = ("aux", "z", "cv", "min_tokens", "max_tokens", "dropped")
    return {f"moe/layer{one['layer']}/{key}": one[key] for one in layers for key in keys}


def log_moe(runner, step: int, logger) -> None:
    """Close ``runner``'s MoE window (every rank of its ``loss`` group together) and print
    its line and write its scalars (the logger's first rank only). Nothing for a runner
    without MoE layers (no ``moe_window``), so dense runs log what they always did."""
    window = getattr(runner, "moe_window", None)
    if window is None:
        return
    layers = window.close(runner.ps.group("loss"), step)
    logger.print(format_moe_line(layers), markup=False)
    logger.scalars(step, moe_scalars(layers))


def moe_metrics(runner) -> dict:
    """The metrics file's ``{"moe": [{"step", "layers": [...]}, ...]}``; {} without MoE."""
    window = getattr(runner, "moe_window", None)
    return {} if window is None else {"moe": window.history}
