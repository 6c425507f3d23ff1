"""Mixture-of-experts with expert parallelism and recomp: routing and all-to-alls run once.

    torchrun --nproc_per_node 2 examples/moe.py

Each layer routes every token to its top-k experts, sends the token copies to
the ranks that hold those experts with ``all_to_all_single`` (uneven splits:
as many rows as the router chose), runs the local experts, and sends the
results back with a second all-to-all that reverses the first.

The layers are recomp checkpoints with three excluded regions:

* the router (gate, softmax, top-k, and the all-to-all that exchanges how many
  tokens each rank will receive): its decision is made once, so the replay
  cannot route differently, and its count exchange is not repeated;
* the dispatch all-to-all and the combine all-to-all: replaying them would
  move every token across the network again.

The experts, by far the largest activations, are recomputed.

Without the exclusions, recomp's checkpoint still does not repeat the
all-to-alls: it keeps their results from the forward and the replay reads them
(``exclude_collectives=False`` repeats them). The router is then recomputed.

The script trains one step in four variants from the same weights and data
(no checkpoint; recomp with the exclusions; recomp without them, with and
without keeping collective results), prints the
collectives each issues per phase, and checks that the routing and the
gradients are identical bit for bit, and that the expert-parallel model agrees
with a dense model holding every expert.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_common import (
    compare,
    exclude_stats,
    main,
    max_rel_diff,
    max_scaled_diff,
    named_grads,
    seeded,
)
from torch import nn

import recomp
from recomp.torch import apply_activation_checkpointing
from recomp.torch.collectives import count_collectives

HIDDEN = 16
FFN = 32
EXPERTS = 4
TOP_K = 2
LAYERS = 2
# Expert-parallel and dense runs group expert rows into different matmuls;
# 1e-5 relative is far above float32 rounding and far below a routing error.
DENSE_RTOL = 1e-5


def tokens_on(rank: int) -> int:
    return 10 + 3 * rank  # ranks hold different numbers of tokens, too


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with explicit splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        ctx.in_splits, ctx.out_splits = in_splits, out_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return out, None, None


class AllToAllExchange(nn.Module):
    """Dispatch or combine: the communication to keep out of the replay."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel

    def forward(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        return AllToAll.apply(x, out_splits, in_splits) if self.parallel else x


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] gate weights of the chosen experts (differentiable)
    experts: torch.Tensor  # [T, k] chosen expert ids
    order: torch.Tensor  # [T*k] token copies sorted by expert, i.e. by destination rank
    send_splits: list[int]  # rows this rank sends to each rank
    recv_splits: list[int]  # rows this rank receives from each rank
    recv_counts: list[list[int]]  # [source rank][local expert] rows received


class Router(nn.Module):
    """Top-k gate plus the exchange of per-expert counts: the routing decision."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.history: list[tuple[bool, torch.Tensor]] = []  # (replaying?, chosen experts)

    def forward(self, h: torch.Tensor) -> Routing:
        probs = F.softmax(self.gate(h), dim=-1)
        weights, experts = probs.topk(TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS)
        received = torch.empty_like(counts)
        if self.world > 1:
            dist.all_to_all_single(received, counts)  # EXPERTS // world counts per rank
        else:
            received.copy_(counts)
        local = EXPERTS // self.world
        recv_counts = received.view(self.world, local)
        self.history.append((recomp.is_recomputing(), experts.detach().clone()))
        return Routing(
            weights,
            experts,
            order,
            counts.view(self.world, local).sum(1).tolist(),
            recv_counts.sum(1).tolist(),
            recv_counts.tolist(),
        )


class Experts(nn.Module):
    """This rank's experts (two-layer GELU MLPs); the part that is recomputed."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.local = EXPERTS // world
        self.w1 = nn.Parameter(torch.empty(self.local, FFN, HIDDEN))
        self.b1 = nn.Parameter(torch.empty(self.local, FFN))
        self.w2 = nn.Parameter(torch.empty(self.local, HIDDEN, FFN))
        self.b2 = nn.Parameter(torch.empty(self.local, HIDDEN))
        self.calls = 0

    def forward(self, rows: torch.Tensor, recv_counts: list[list[int]]) -> torch.Tensor:
        self.calls += 1
        # Received rows come grouped by source rank, then by local expert.
        sizes = [n for per_source in recv_counts for n in per_source]
        segments = list(rows.split(sizes))
        for e in range(self.local):
            idx = [src * self.local + e for src in range(self.world)]
            x = torch.cat([segments[i] for i in idx])
            y = F.linear(F.gelu(F.linear(x, self.w1[e], self.b1[e])), self.w2[e], self.b2[e])
            for i, part in zip(idx, y.split([sizes[i] for i in idx])):
                segments[i] = part
        return torch.cat(segments)


class MoELayer(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.router = Router(world)
        self.dispatch = AllToAllExchange(world > 1)
        self.experts = Experts(world)
        self.combine = AllToAllExchange(world > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        r = self.router(h)
        copies = h.index_select(0, r.order // TOP_K)
        received = self.dispatch(copies, r.recv_splits, r.send_splits)
        y = self.experts(received, r.recv_counts)
        returned = self.combine(y, r.send_splits, r.recv_splits)
        unsorted = returned[torch.argsort(r.order)]
        mixed = (unsorted.view(x.shape[0], TOP_K, HIDDEN) * r.weights.unsqueeze(-1)).sum(1)
        return x + mixed


class MoEModel(nn.Module):
    """``world=1`` is the dense model: every expert local, no communication."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(world) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def dense_parameters(seed: int = 0) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    params = {}
    for name, p in MoEModel(world=1).named_parameters():
        if name.endswith(("w1", "w2", "gate.weight")):
            params[name] = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        elif name.endswith("norm.weight"):
            params[name] = 1 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            params[name] = 0.1 * torch.randn(p.shape, generator=g)
    return params


def shard(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if ".experts." in name:
        return full.chunk(world, dim=0)[rank]  # experts rank*E/world ... (rank+1)*E/world - 1
    return full  # gate and norm are replicated


# variant -> (exclusions?, checkpoint options)
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "recomp": (True, {}),
    "recomp_no_exclusion": (False, {"exclude_collectives": False}),
    # No region excluded: the router is recomputed, the replay reads the all-to-alls' results.
    "recomp_collectives_kept": (False, {}),
}


def is_excluded(m: nn.Module) -> bool:
    return isinstance(m, (Router, AllToAllExchange))


def build(variant: str, rank: int, world: int, dense: dict[str, torch.Tensor]) -> MoEModel:
    model = MoEModel(world)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(name, dense[name], rank, world))
    if variant != "reference":
        exclude, options = VARIANTS[variant]
        apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda m: isinstance(m, MoELayer),
            exclude_fn=is_excluded if exclude else None,
            **options,
        )
    return model


def routers(model: nn.Module) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def run(rank: int, world_size: int) -> dict[str, Any]:
    assert EXPERTS % world_size == 0
    dense = dense_parameters()
    x = torch.randn(tokens_on(rank), HIDDEN, generator=seeded(100 + rank))
    report: dict[str, Any] = {"title": "MoE expert parallel", "rank": rank, "variants": {}}

    outputs, grads, routing = {}, {}, {}
    for variant in ("reference", *VARIANTS):
        model = build(variant, rank, world_size, dense)
        with count_collectives() as counts:
            out = model(x)
            out.square().mean().backward()
        outputs[variant], grads[variant] = out.detach(), named_grads(model)
        forward_routing = [[e for replay, e in r.history if not replay] for r in routers(model)]
        replay_routing = [[e for replay, e in r.history if replay] for r in routers(model)]
        routing[variant] = [f[0] for f in forward_routing]
        entry: dict[str, Any] = {
            "counts": counts.as_dict(),
            "exclusions": exclude_stats(model),
            "router_forward_runs": [len(f) for f in forward_routing],
            "router_replay_runs": [len(r) for r in replay_routing],
            "expert_calls": [m.calls for m in model.modules() if isinstance(m, Experts)],
            "replayed_routing_equal": all(
                torch.equal(e, f[0]) for f, r in zip(forward_routing, replay_routing) for e in r
            ),
        }
        if variant == "reference":
            layer0 = model.layers[0]
            r0 = layer0.router(layer0.norm(x))
            report["splits_layer0"] = {"send": r0.send_splits, "recv": r0.recv_splits}
        else:
            entry["grads_vs_reference"] = compare(grads[variant], grads["reference"])
            entry["output_equal"] = bool(torch.equal(outputs[variant], outputs["reference"]))
            entry["routing_equal"] = all(
                torch.equal(a, b) for a, b in zip(routing[variant], routing["reference"])
            )
        report["variants"][variant] = entry

    # The expert-parallel reference against a dense model with every expert on
    # this rank. Expert gradients of the dense model cover this rank's tokens
    # only: sum them over ranks to get what expert parallelism computes.
    dense_model = build("reference", 0, 1, dense)
    dense_out = dense_model(x)
    dense_out.square().mean().backward()
    dense_grads = named_grads(dense_model)
    for name, g in dense_grads.items():
        if ".experts." in name:
            dist.all_reduce(g)
    report["dense"] = {
        "output_max_rel_diff": max_rel_diff(outputs["reference"], dense_out.detach()),
        "grad_max_rel_diff": max_scaled_diff(
            (grads["reference"][n], shard(n, g, rank, world_size)) for n, g in dense_grads.items()
        ),
        "rtol": DENSE_RTOL,
    }

    v = report["variants"]
    per_layer = 3  # count exchange, dispatch, combine
    report["layers"] = LAYERS
    report["checks"] = checks = {
        "replay issues no collective (with exclusions, or collectives kept)": all(
            v[k]["counts"]["replay"] == {} for k in ("recomp", "recomp_collectives_kept")
        ),
        "replay repeats all three all-to-alls (without exclusions or kept collectives)": v[
            "recomp_no_exclusion"
        ][
            "counts"
        ]["replay"]
        == {"all_to_all": per_layer * LAYERS},
        "router runs once per layer (with exclusions)": v["recomp"]["router_forward_runs"]
        == [1] * LAYERS
        and v["recomp"]["router_replay_runs"] == [0] * LAYERS,
        "experts are recomputed": v["recomp"]["expert_calls"] == [2] * LAYERS,
        "routing identical to the non-checkpointed model": all(
            v[k]["routing_equal"] for k in VARIANTS
        ),
        "gradients bit-for-bit equal to the non-checkpointed model": all(
            v[k]["grads_vs_reference"]["bitwise_equal"] and v[k]["output_equal"] for k in VARIANTS
        ),
        "expert parallel matches the dense model": report["dense"]["output_max_rel_diff"]
        < DENSE_RTOL
        and report["dense"]["grad_max_rel_diff"] < DENSE_RTOL,
    }
    report["ok"] = all(checks.values())
    return report


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
