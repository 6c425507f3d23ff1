"""Worker side of test_fit_layouts.py: a small Llama built by ``recomp.plan.models``
(``SimulatedModel`` with a spec of its own) on 2 real gloo ranks, under tensor
parallelism, tensor parallelism with loss parallelism (``torch.distributed.tensor.
parallel.loss_parallel()`` around the forward and the backward) and context
parallelism. Per rank: ``profile()`` of it, the bytes autograd holds for backward at
the end of one forward and loss (each storage once, parameters and inputs left out),
the loss, and under context parallelism the gradients summed over the ranks beside
those of the whole sequence on one rank."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from recomp.plan import profile
from recomp.plan._specs import ModelSpec
from recomp.plan.modelcall import call_model, default_loss, tensors_of
from recomp.plan.models import SimulatedModel, candidate_regions

TINY = ModelSpec(
    "tiny-llama",
    "llama",
    {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "tests/distributed/fit_layouts_cases.py",
    0,
)  # fmt: skip
SEQ, BATCH = 32, 2
LAYOUTS = {
    "tp": {"tp": 2, "sp": True},
    "tp+loss_parallel": {"tp": 2, "sp": True, "loss_parallel": True},
    "cp": {"cp": 2},
}


def simulated(layout: str) -> SimulatedModel:
    return SimulatedModel(
        TINY, seq=SEQ, batch=BATCH, dtype=torch.float32, device="cpu", **LAYOUTS[layout]
    )


def inputs(model: SimulatedModel, mesh: Any) -> dict[str, Any]:
    """The rank's inputs, the same tokens on every rank; the loss summed over the
    sequence's tokens and divided by their count (so that the ranks' losses add up)."""
    torch.manual_seed(1)
    x = model.inputs(mesh)
    x["num_items_in_batch"] = BATCH * (SEQ - 1)
    return x


def saved_bytes(model: torch.nn.Module, x: dict[str, Any]) -> tuple[int, float]:
    """The bytes autograd holds for backward at the end of the forward and the loss (each
    storage once; parameters, buffers and inputs are not activations), and the loss."""

    def local(t: torch.Tensor) -> torch.Tensor:
        # A tensor subclass that wraps a local tensor (DTensor, a collective's result
        # not yet waited for): the local tensor holds the memory.
        while type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(
            t, "__tensor_flatten__"
        ):
            names, _ = t.__tensor_flatten__()
            t = getattr(t, names[0])
        return t

    skip = {
        local(t).untyped_storage().data_ptr()
        for t in [*model.parameters(), *model.buffers(), *tensors_of(x)]
    }
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = default_loss(call_model(model, x))
    value = float(loss.detach())
    loss.backward()
    return sum(held.values()), value


def run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        model = simulated(name)
        torch.manual_seed(0)
        net = model.build(mesh)
        x = inputs(model, mesh)
        context = loss_parallel() if layout.get("loss_parallel") else contextlib.nullcontext()
        with context:
            prof = profile(net, x, steps=1, clock="cpu", exclude=candidate_regions)
            saved, loss = saved_bytes(net, x)
        results[name] = {"profile": prof.to_dict(), "saved": saved, "loss": loss}
        if name == "cp":
            results[name]["gradients_match"] = _cp_gradients_match(net, loss)
    return {"rank": rank, **results}


def _cp_gradients_match(net: torch.nn.Module, loss: float) -> bool:
    """The context-parallel ranks' gradients and losses, summed, against the whole
    sequence's on one rank (the model built the same way on one process)."""
    total = torch.tensor([loss])
    dist.all_reduce(total)
    grads = {}
    for name, p in net.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g
    whole_model = SimulatedModel(TINY, seq=SEQ, batch=BATCH, dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    whole = whole_model.build(None)
    x = inputs(whole_model, None)
    whole_loss = default_loss(call_model(whole, x))
    whole_loss.backward()
    same_loss = torch.allclose(total, whole_loss.detach().reshape(1), rtol=1e-5, atol=1e-6)
    return same_loss and all(
        torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6)
        for name, p in whole.named_parameters()
    )
