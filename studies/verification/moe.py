"""Layout equivalence for mixture-of-experts models (``--experts E``, ``--ep-size N``).

The target trains one step as the runtime does: the local runner adds every router's
auxiliary and z-losses to the model loss, and the gradients reduce through GradSync, the
experts' over the ``expert_grad`` group. Each rank routes its own tokens (its DP slice),
so the capacity and the load-balancing statistics are those of that slice at every ep
size; the reference is therefore the unsplit model run once per DP slice, in slice order,
on the objective the runner defines: the mean over slices of (model loss + router
losses), one backward.

Compared, in model order (each MoE layer's rows where its router runs):

* ``routes``: the set of kept (token, expert) pairs, tokens numbered over the global batch
  (DP slice by slice, ``[s, b]`` order inside one); max abs is the size of the symmetric
  difference, max rel that over the reference's pairs. ``dropped``: the same for the
  token-slots dropped past capacity (with ``--capacity-factor``).
* ``weights``: each token's k routing weights; ``aux loss`` and ``z loss``: the router's
  unweighted losses, the mean over DP slices.
* the experts' output rows, in (expert, source DP rank, token) order: the target's ep
  ranks each hold ``E / ep`` experts and receive their rows from the ``expert`` group by
  all-to-all; the rows are put back in that order from the routing counts. At tp > 1
  each TP rank's rows are its slice's partial sums (every TP rank routes and dispatches
  alike), summed over TP before the comparison.
* every other module's output (the MoE layer's own: after the combine all-to-all, the
  inverse permutation and the TP sum), joined over TP as the dense verifier's, the loss
  and the summed router loss, and every gradient, the experts' gathered over TP and the
  ``expert`` group to ``[E, ...]`` (by ``full_grad_dict``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from engine import comm
from engine.models import FAMILIES, family, preset
from engine.models.base import ParallelLMHead
from engine.runner import LocalRunner
from layers.mappings import gather_along
from layers.moe import GroupedExperts, MoEMLP, moe_losses
from layers.router import TopKRouter
from studies.verification.dp_step import TargetStep
from studies.verification.outputs import OutputCapture, Row, compare, join_tp, output_tp_dim

AUX_COEFF, Z_COEFF = 0.01, 0.001  # both router losses reach the objective (and its gradient)


def check_moe(spec) -> None:
    """One line (ValueError) if the MoE part of ``spec`` cannot run: ep must divide dp and
    the experts; dropless at cp > 1; the router's options only with experts."""
    ep, dp, experts = spec.ep_size, spec.dp_size, spec.experts
    if experts < 0:
        raise ValueError(f"experts={experts} must be >= 0 (0: dense MLPs)")
    if spec.shared_ffn < 0:
        raise ValueError(f"shared_ffn={spec.shared_ffn} must be >= 0 (0: no shared expert)")
    moe_only = dict(
        top_k=2, capacity_factor=None, router="softmax", shared_ffn=0
    )  # VerifySpec's defaults
    if not experts and ep == 1:
        changed = [key for key, value in moe_only.items() if getattr(spec, key) != value]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} set the MoE layers of experts > 0; experts=0 is dense"
            )
        return
    if experts < 1:
        raise ValueError(
            f"ep_size={ep} splits the experts of an MoE model: set experts (--experts E) to a "
            f"multiple of {ep}"
        )
    if dp % ep or experts % ep:
        fits = [n for n in range(1, math.gcd(dp, experts) + 1) if not dp % n and not experts % n]
        raise ValueError(
            f"ep_size={ep} must divide dp_size={dp} and experts={experts} (expert parallelism "
            f"is carved from the dp ranks, and each ep rank holds whole experts); choose "
            f"ep_size in {fits}"
        )
    biasless = [name for name in FAMILIES if not _tiny(name).linear_bias]
    if spec.model not in biasless:
        raise ValueError(
            f"experts={experts} runs in --model {' or '.join(biasless)} (experts carry no "
            f"biases; the {spec.model} tiny model's linears do)"
        )
    if spec.cp_size > 1 and spec.capacity_factor is not None:
        raise ValueError(
            f"experts={experts} at cp_size={spec.cp_size} runs dropless (a capacity would cover "
            f"each cp rank's part of the sequences): drop capacity_factor={spec.capacity_factor}"
        )


def _tiny(model: str):
    """The family's tiny preset (the verifier's model takes its component choices)."""
    return preset(f"{family(model).arch}_tiny")


def moe_config_keys(spec) -> dict:
    """The model config's MoE keys for ``spec`` (none for a dense model). The router runs
    in fp64 when the model does, so a float64 comparison proves the routing exactly."""
    if not spec.experts:
        return {}
    return dict(
        mlp="moe",
        moe_num_experts=spec.experts,
        moe_top_k=spec.top_k,
        moe_ffn_hidden_size=spec.hidden_size,
        moe_router=spec.router,
        moe_router_dtype="fp64" if spec.dtype == "float64" else "fp32",
        moe_capacity_factor=spec.capacity_factor,
        moe_shared_ffn_hidden_size=spec.shared_ffn,
        moe_aux_loss_coeff=AUX_COEFF,
        moe_z_loss_coeff=Z_COEFF,
    )


def _batch_dim(t: torch.Tensor) -> int:
    """Inside the models 3-D activations are ``[s, b, ...]``, others ``[b or T, ...]``."""
    return 1 if t.dim() == 3 else 0


class MoECapture(OutputCapture):
    """Every module's output, plus each router's ``Routing`` and losses and each MoE
    layer's own output (a tuple), as ``records[name] = (kind, [one per forward])``.
    ``every``: keep every forward (the reference runs once per DP slice), else the first
    (the target; recomputation runs the forwards again)."""

    def __init__(self, model: nn.Module, *, every: bool) -> None:
        self.every = every
        self.records: dict[str, tuple[str, list]] = {}
        self.vocab = model.cfg.vocab_size
        super().__init__(model)

    def _keep(self, name, trim, module, args, out) -> None:
        if isinstance(module, TopKRouter):
            losses = module.last_losses
            kind = "router"
            value = dict(
                experts=out.experts.detach().clone(),
                keep=None if out.keep is None else out.keep.clone(),
                weights=out.weights.detach().clone(),
                aux=losses.aux.detach().clone(),
                z=losses.z.detach().clone(),
            )
        elif isinstance(module, GroupedExperts):
            kind, value = "experts", out.detach().clone()
        elif isinstance(module, MoEMLP):
            kind, value = "output", (out[0].detach().clone(), output_tp_dim(module), 1, None)
        elif isinstance(out, torch.Tensor):
            # The vocabulary is trimmed after the TP join (its padding is per TP size).
            trim = self.vocab if isinstance(module, ParallelLMHead) else None
            copies = getattr(module, "copies", 1)
            kind, value = "output", (out.detach().clone(), output_tp_dim(module), copies, trim)
        else:
            return
        if name not in self.records:
            self.records[name] = (kind, [value])
        elif self.every:
            self.records[name][1].append(value)


def _trimmed(t: torch.Tensor, trim: int | None) -> torch.Tensor:
    """``t`` with its last dim cut to ``trim`` (the true vocabulary; None: as it is)."""
    return t if trim is None else t[..., :trim]


def _kept_counts(route: dict, experts: int) -> torch.Tensor:
    """``[E]``: the token-slots of one forward each expert computed (kept ones)."""
    chosen = route["experts"].reshape(-1)
    if route["keep"] is not None:
        chosen = chosen[route["keep"].reshape(-1)]
    return torch.bincount(chosen, minlength=experts)


def _keep_mask(route: dict) -> torch.Tensor:
    """``[T, k]`` bool: which token-slots fit the capacity (all of them when dropless)."""
    if route["keep"] is None:
        return torch.ones_like(route["experts"], dtype=torch.bool)
    return route["keep"]


def _pairs(experts: torch.Tensor, keep: torch.Tensor) -> tuple[set, set]:
    """(kept, dropped) (token, expert) pairs; ``experts``, ``keep`` ``[T, k]`` of the
    global batch."""
    kept, dropped = set(), set()
    for t, (chosen, fits) in enumerate(zip(experts.tolist(), keep.tolist(), strict=True)):
        for e, k in zip(chosen, fits, strict=True):
            (kept if k else dropped).add((t, e))
    return kept, dropped


def _set_row(kind: str, name: str, got: set, want: set) -> Row:
    differ = len(got ^ want)
    return Row(kind, name, float(differ), differ / max(1, len(want)), differ == 0)


class _Side:
    """One side's captured forwards joined over the global batch (DP slice order)."""

    def __init__(self, capture: MoECapture, ps, experts: int, *, target: bool) -> None:
        self.ps, self.experts, self.target = ps, experts, target
        self.records = capture.records

    def output(self, values: list) -> torch.Tensor:
        """One module's output over the global batch: the target's joined over TP (then its
        vocabulary trimmed) and DP, the reference's (tp 1) slices concatenated."""
        if not self.target:
            full = [_trimmed(v[0], v[3]) for v in values]
            return torch.cat(full, dim=_batch_dim(full[0]))
        out, tp_dim, copies, trim = values[0]
        out = _trimmed(join_tp(out, tp_dim, copies, self.ps.tp_group), trim)
        return gather_along(out, _batch_dim(out), self.ps.dp_group)

    def route(self, values: list) -> dict:
        """experts, keep, weights ``[T_global, k]``; aux and z: the mean over DP slices."""
        if not self.target:
            joined = {key: torch.cat([v[key] for v in values]) for key in ("experts", "weights")}
            joined["keep"] = torch.cat([_keep_mask(v) for v in values])
            for key in ("aux", "z"):
                joined[key] = sum(v[key] for v in values) / len(values)
            return joined
        one, keep = values[0], _keep_mask(values[0])
        group = self.ps.dp_group
        joined = {
            "experts": gather_along(one["experts"], 0, group),
            "weights": gather_along(one["weights"], 0, group),
            "keep": gather_along(keep.long(), 0, group).bool(),
        }
        for key in ("aux", "z"):
            total = one[key].clone()
            comm.sum_(total, self.ps.group("loss"))
            joined[key] = total / self.ps.size("loss")
        return joined

    def expert_rows(self, values: list, routes: list) -> dict | None:
        """``{(expert, source DP rank): rows}`` of one MoE layer's experts (on rank 0 of
        the target, every reference slice's); ``routes``: its router's forwards."""
        if not self.target:
            pieces = {}
            for source, (rows, route) in enumerate(zip(values, routes, strict=True)):
                counts = _kept_counts(route, self.experts).tolist()
                for e, chunk in enumerate(rows.split(counts)):
                    pieces[(e, source)] = chunk
            return pieces
        ps = self.ps
        mine = _kept_counts(routes[0], self.experts)
        counts = gather_along(mine.unsqueeze(0), 0, ps.dp_group)  # [dp, E], by DP rank
        ep, ep_rank = ps.size("expert"), ps.rank_in("expert")
        per_rank = self.experts // ep
        # The expert group's members in its rank order, as DP ranks (cp 1, pp 1).
        group = next(g for g in ps.dims.group_ranks("expert") if ps.rank in g)
        members = [ps.dims.coords_of(r)["dp"] for r in group]
        rows, start, pieces = values[0].clone(), 0, {}
        comm.sum_(rows, ps.tp_group)  # each TP rank's slice of every expert: partial sums
        for e in range(ep_rank * per_rank, (ep_rank + 1) * per_rank):
            for source in members:
                n = int(counts[source, e])
                pieces[(e, source)] = rows[start : start + n]
                start += n
        if start != len(rows):
            pieces[("extra", ps.rank)] = rows[start:]  # rows no routing accounts for
        everyone = [None] * ps.dp_size
        dist.all_gather_object(everyone, pieces, group=ps.dp_group)
        return {k: v for one in everyone for k, v in one.items()}


def _expert_row(name: str, got: dict, want: dict, tol: float) -> Row:
    """The experts' output rows in (expert, source) order, both sides."""
    if set(got) != set(want):
        return Row("output", name, math.inf, math.inf, False)
    order = sorted(want)
    return compare(
        "output", name, torch.cat([got[k] for k in order]), torch.cat([want[k] for k in order]), tol
    )


def _capture_rows(target: MoECapture, reference: MoECapture | None, spec, ps, tol):
    """(rows, notes) of the first step's forwards (a collective: every rank joins)."""
    got = _Side(target, ps, spec.experts, target=True)
    want = None if reference is None else _Side(reference, ps, spec.experts, target=False)
    rows, notes = [], []
    routes_of, ref_routes_of = {}, {}  # MoE layer -> its router's forwards
    # At cp > 1 a forward's outputs and routes are this cp rank's part of each sequence:
    # compared at cp 1; at cp > 1 the losses (router losses included) and gradients are.
    context = ps.size("cp") > 1
    for name, (kind, values) in got.records.items():
        if kind != "router" and context:
            continue
        if kind == "output":
            full = got.output(values)
            if want is not None:
                rows.append(compare("output", name, full, want.output(want.records[name][1]), tol))
        elif kind == "router" and context:
            mine = got.route(values)
            if want is not None:
                theirs = want.route(want.records[name][1])
                rows.append(compare("aux loss", name, mine["aux"], theirs["aux"], tol))
                rows.append(compare("z loss", name, mine["z"], theirs["z"], tol))
        elif kind == "router":
            routes_of[name.rsplit(".", 1)[0]] = values
            mine = got.route(values)
            if want is None:
                continue
            ref_values = want.records[name][1]
            ref_routes_of[name.rsplit(".", 1)[0]] = ref_values
            theirs = want.route(ref_values)
            kept, dropped = _pairs(mine["experts"], mine["keep"])
            ref_kept, ref_dropped = _pairs(theirs["experts"], theirs["keep"])
            rows.append(_set_row("routes", name, kept, ref_kept))
            if spec.capacity_factor is not None:
                rows.append(_set_row("dropped", name, dropped, ref_dropped))
            rows.append(compare("weights", name, mine["weights"], theirs["weights"], tol))
            rows.append(compare("aux loss", name, mine["aux"], theirs["aux"], tol))
            rows.append(compare("z loss", name, mine["z"], theirs["z"], tol))
            notes.append(
                f"{name}: {len(ref_kept)} token-slots routed, {len(ref_dropped)} dropped "
                f"(target {len(kept)}, {len(dropped)})"
            )
        else:  # the experts' rows
            layer = name.rsplit(".", 1)[0]
            pieces = got.expert_rows(values, routes_of[layer])
            if want is not None:
                ref = want.expert_rows(want.records[name][1], ref_routes_of[layer])
                rows.append(_expert_row(name, pieces, ref, tol))
    return rows, notes


def _move_biases(reference, loads: list[list[torch.Tensor]]) -> None:
    """The reference's sigmoid routers' biases moved by the whole batch's load (``loads``:
    each DP slice's slots per router), as the target's runner moves them by the load
    summed over its dp ranks."""
    routers = [m for m in reference.modules() if isinstance(m, TopKRouter)]
    for router, *per_slice in zip(routers, *loads, strict=True):
        if router.kind == "sigmoid":
            router.update_bias(sum(per_slice))


def moe_train_and_compare(spec, target, reference, batch, local, ps):
    """Train ``spec.steps`` steps of the target (this rank's DP slice ``local``) and of the
    reference (the global ``batch``, slice by slice); (rows, notes) on rank 0."""
    tol, rows, notes = spec.tolerance, [], []
    captures = []  # a compiled target's graphs span its modules: no module output its own
    if not spec.compile:
        captures.append(MoECapture(target, every=False))
        if reference is not None:
            captures.append(MoECapture(reference, every=True))
    step = TargetStep(spec, target, ps)
    runner = LocalRunner(target, ps, contextlib.nullcontext)
    model_losses: list[torch.Tensor] = []  # the fp64 loss the runner backpropagates
    original_loss = target.loss
    target.loss = lambda b: model_losses.append(original_loss(b)) or model_losses[-1]
    ref_opt = None
    if reference is not None:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=spec.lr, weight_decay=0.0)
    slices = [{k: v.chunk(spec.dp_size)[i] for k, v in batch.items()} for i in range(spec.dp_size)]
    for n in range(spec.steps):
        model_losses.clear()
        runner.forward_backward([local], step)
        step.finish_grads()
        loss = model_losses[0].detach().double()
        router = sum(one.loss for one in moe_losses(target)).detach().double()
        for value in (loss, router):
            comm.sum_(value, ps.group("loss"))
            value /= ps.size("loss")
        ref_loss = ref_router = None
        if reference is not None:
            losses, routers, loads = [], [], []
            for one in slices:
                losses.append(reference.loss(one))
                routers.append(sum(r.loss for r in moe_losses(reference)))
                loads.append([r.slots_per_expert for r in moe_losses(reference)])
            ref_loss, ref_router = sum(losses) / len(slices), sum(routers) / len(slices)
            (ref_loss + ref_router).backward()
        if n == 0 and captures:
            found, notes = _capture_rows(
                captures[0], captures[-1] if reference else None, spec, ps, tol
            )
            rows += found
            for c in captures:
                c.remove()
        if reference is not None:
            rows.append(compare("loss", f"loss (step {n})", loss, ref_loss, tol))
            rows.append(compare("loss", f"router loss (step {n})", router, ref_router, tol))
        if n == 0 and spec.dp_shard != "optimizer":  # ZeRO-1 keeps them in its buckets
            got = target.full_grad_dict()  # over TP, and the experts over ep (collective)
            if reference is not None:
                want = reference.full_grad_dict()
                rows += [compare("grad", k, got[k], want[k], tol) for k in reversed(got)]
        step.step()
        step.zero_grad(set_to_none=True)
        if ref_opt is not None:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            _move_biases(reference, loads)
    step.remove()
    del target.loss  # the class's again
    return rows, notes
