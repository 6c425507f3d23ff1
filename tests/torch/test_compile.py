"""recomp under torch.compile: no graph break, gradients of eager recomp, excluded ops run once.

Most tests compile with ``aot_eager`` (AOTAutograd and the min-cut partitioner, no code
generation); the ``inductor`` ones build C++ and are kept few. How often an excluded
region runs is counted with a custom op that increments a Python counter: a compiled
program calls it once per execution, so a recomputed region shows up as a second call.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from recomp.torch import (
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_exclude_wrapper,
    checkpoint_wrapper,
)

CALLS = {"tally": 0}


@torch.library.custom_op("recomp_test::tally", mutates_args=())
def tally(x: torch.Tensor) -> torch.Tensor:
    """Identity that counts its executions (eager or compiled)."""
    CALLS["tally"] += 1
    return x.clone()


@tally.register_fake
def _tally_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tally.register_autograd(lambda ctx, grad: grad)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- models


class Attention(nn.Module):
    """Stands for the part to exclude; ``tally`` counts how often it runs."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(tally(attn))


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class PlainCheckpoint(nn.Module):
    """The control: PyTorch's own non-reentrant checkpoint around a layer."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(self.inner, x, use_reentrant=False)


def make_stack(kind: str, layers: int = 2) -> Stack:
    """``kind``: none, recomp (attention excluded), recomp-full (no exclusion), torch."""
    torch.manual_seed(0)
    model = Stack(layers)
    if kind == "recomp":
        apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda m: isinstance(m, Block),
            exclude_fn=lambda m: isinstance(m, Attention),
        )
    elif kind == "recomp-full":
        apply_activation_checkpointing(model, checkpoint_fn=lambda m: isinstance(m, Block))
    elif kind == "torch":
        for i, layer in enumerate(list(model.layers)):
            model.layers[i] = PlainCheckpoint(layer)
    return model


def example(hidden: int = 16) -> torch.Tensor:
    return torch.randn(2, 6, hidden, generator=torch.Generator().manual_seed(1))


def grads_of(model: nn.Module, run: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of one step (parameters in order), counting ``tally`` calls."""
    model.zero_grad(set_to_none=True)
    run().sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def tally_calls(run: Callable[[], Any]) -> int:
    CALLS["tally"] = 0
    run()
    return CALLS["tally"]


def compiled_tally_against_eager(step: Any, w: torch.Tensor, check_breaks: bool = False) -> int:
    """Run ``step`` on a fresh input eagerly, then compiled (aot_eager, fullgraph): the
    compiled gradients of the input and ``w`` must equal the eager ones. Returns how often
    the counted op ran in one compiled step (after a first one that compiles)."""
    x = torch.randn(4, 8, requires_grad=True)
    step(x).backward()
    eager = [x.grad.clone(), w.grad.clone()]  # type: ignore[union-attr]
    x.grad = w.grad = None
    if check_breaks:
        assert explain_breaks(step, x) == []
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(x).backward()
    x.grad = w.grad = None
    runs = tally_calls(lambda: compiled(x).backward())
    assert_equal([x.grad, w.grad], eager)  # type: ignore[list-item]
    return runs


def assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (g - e).abs().max()


def explain_breaks(fn: Callable[..., Any], *args: Any) -> list[str]:
    explanation = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return [str(b.reason) for b in explanation.break_reasons]


# --------------------------------------------------------------------------- compile at all


@pytest.mark.parametrize("kind", ["recomp", "recomp-full"])
def test_whole_model_compiles_fullgraph_with_eager_gradients(kind: str) -> None:
    model = make_stack(kind)
    x = example()
    eager = grads_of(model, lambda: model(x))
    # fullgraph=True: any graph break would raise.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_equal(grads_of(model, lambda: compiled(x)), eager)


def test_per_block_compile_like_torchtitan() -> None:
    model = make_stack("recomp")
    x = example()
    eager = grads_of(model, lambda: model(x))
    for i, layer in enumerate(list(model.layers)):
        model.layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
    grads_of(model, lambda: model(x))  # compiles
    calls = tally_calls(lambda: grads_of(model, lambda: model(x)))
    assert calls == 2  # one per layer
    assert_equal(grads_of(model, lambda: model(x)), eager)


def test_per_block_compile_shares_one_graph_across_blocks() -> None:
    # More blocks than Dynamo compiles of one code object before it gives up (8): the
    # blocks' regions differ only in their names, which the compiled graph must not read
    # (one graph per block ran past the limit, and later blocks ran uncompiled). One
    # graph for all blocks, and one more once the first forward's reach check removed its
    # hooks from the wrapped modules.
    from torch._dynamo.utils import counters

    blocks = 10
    model = make_stack("recomp", layers=blocks)
    x = example()
    eager = grads_of(model, lambda: model(x))
    for i, layer in enumerate(list(model.layers)):
        model.layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
    counters.clear()
    for _ in range(2):
        grads_of(model, lambda: model(x))
    assert counters["stats"]["unique_graphs"] <= 2
    assert tally_calls(lambda: grads_of(model, lambda: model(x))) == blocks  # one per block
    assert counters["stats"]["unique_graphs"] <= 2
    assert_equal(grads_of(model, lambda: model(x)), eager)


def test_blocks_compiled_before_the_first_forward_count_as_reached() -> None:
    # The reach check's hooks run traced in the compiled blocks: a checkpointed block's
    # own hook (outside its checkpoint) records the call, so the first forward does not
    # say that no wrapper was reached; the check then removes its hooks as in eager mode.
    import recomp

    model = make_stack("recomp")
    for i, layer in enumerate(list(model.layers)):
        model.layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = example()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.WrapperNotReachedWarning)
        grads_of(model, lambda: model(x))
    assert not any(m._forward_pre_hooks for m in model.modules())
    # A compiled forward that bypasses the wrappers (the blocks' forwards bound before
    # wrapping) is still found out.
    plain = Stack(2)
    forwards = [block.forward for block in plain.layers]
    apply_activation_checkpointing(plain, checkpoint_fn=lambda m: isinstance(m, Block))

    def bypass(h: torch.Tensor) -> torch.Tensor:
        for forward in forwards:
            h = forward(h)
        return h

    plain.forward = torch.compile(bypass, backend="aot_eager")  # type: ignore[method-assign]
    with pytest.warns(recomp.WrapperNotReachedWarning, match="wrapped 'layers.0'"):
        plain(x)


def test_checkpoint_function_and_wrapper_compile_fullgraph() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    region = checkpoint_exclude_wrapper(lambda t: tally(torch.sin(t @ w)))
    block = checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))

    def step(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.cos(region(torch.relu(t))) @ w, x)
        return block(h).sum()

    assert compiled_tally_against_eager(step, w, check_breaks=True) == 1


# --------------------------------------------------------------------------- run once


@pytest.mark.parametrize("kind, runs_per_layer", [("recomp", 1), ("recomp-full", 2), ("torch", 2)])
def test_excluded_region_runs_once_per_step_compiled(kind: str, runs_per_layer: int) -> None:
    # recomp-full and torch are the controls: without an exclusion the partitioner
    # recomputes the attention in backward, so its custom op runs a second time.
    model = make_stack(kind)
    x = example()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(x).sum().backward()  # compiles
    assert tally_calls(lambda: compiled(x).sum().backward()) == runs_per_layer * 2
    assert tally_calls(lambda: compiled(x)) == 2  # forward only: once per layer


def test_region_outside_a_checkpoint_is_a_plain_call_compiled() -> None:
    region = checkpoint_exclude_wrapper(Attention(8))
    x = torch.randn(2, 4, 8)
    eager = grads_of(region, lambda: region(x))
    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    assert tally_calls(lambda: grads_of(region, lambda: compiled(x))) == 1
    assert_equal(grads_of(region, lambda: compiled(x)), eager)


def test_graph_break_inside_a_checkpoint_falls_back_with_a_warning() -> None:
    # Dynamo cannot capture a checkpoint whose body breaks the graph; PyTorch then runs
    # it as a plain checkpoint, which replays the region: recomp says so, and the
    # gradients stay those of eager recomp.
    from recomp.errors import ForeignCheckpointWarning

    class Breaking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.region = checkpoint_exclude_wrapper(nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            torch._dynamo.graph_break()
            return torch.sin(self.region(tally(h)))

    torch.manual_seed(0)
    model = checkpoint_wrapper(Breaking())
    x = torch.randn(4, 8, requires_grad=True)
    eager = grads_of(model, lambda: model(x))
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(ForeignCheckpointWarning, match="not in effect"):
        assert_equal(grads_of(model, lambda: compiled(x)), eager)


class _Store:
    """An object from outside the model that an excluded region writes to (as HF's
    KV cache lazily sets its device at its first update)."""

    ready = False


class _Writing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, store: _Store) -> torch.Tensor:
        y = self.lin(x)
        if not store.ready:
            store.device = y.device
            store.ready = True
        return y.to(store.device)


class _WritingBlock(nn.Module):
    def __init__(self, exclude: bool) -> None:
        super().__init__()
        writing = _Writing()
        self.attn = checkpoint_exclude_wrapper(writing) if exclude else writing
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, store: _Store) -> torch.Tensor:
        return self.mlp(torch.relu(self.attn(x, store)))


@pytest.mark.parametrize("exclude", [True, False], ids=["excluded", "nothing-excluded"])
def test_a_block_dynamo_gives_up_on_runs_recomp_eagerly(exclude: bool) -> None:
    # A write to an object from outside inside the checkpoint is a side effect Dynamo
    # will not capture. Dynamo 2.13 on gives up on the wrapper's frame and runs it
    # eagerly, with its frame callback still set: recomp's eager checkpoint then runs
    # untraced (traced, it gave Dynamo an internal error), so the exclusion is in effect
    # and the gradients are eager recomp's, step after step. Dynamo 2.9 breaks the graph
    # inside the checkpoint instead, and PyTorch runs it as a plain checkpoint: the
    # fallback the compile guide describes (the region replayed, with a warning).
    from recomp.errors import ForeignCheckpointWarning

    torch.manual_seed(0)
    blocks = [_WritingBlock(exclude) for _ in range(2)]
    reference = nn.ModuleList(blocks)
    model = nn.ModuleList(checkpoint_wrapper(copy.deepcopy(b)) for b in blocks)

    def run(layers: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            store, h = _Store(), x
            for i in range(2):
                h = layers(i, h, store)
            return h

        return forward

    x = torch.randn(4, 8, requires_grad=True)
    expected = grads_of(reference, run(lambda i, h, store: reference[i](h, store)))
    compiled = torch.compile(lambda i, h, store: model[i](h, store), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_equal(grads_of(model, run(compiled)), expected)
    fell_back = [w for w in caught if issubclass(w.category, ForeignCheckpointWarning)]
    if torch.__version__ >= "2.13":
        assert not fell_back, [str(w.message) for w in fell_back]
        if exclude:
            assert [b.attn.region_runs for b in model] == [2, 2]
            assert [b.attn.region_skips for b in model] == [2, 2]
    else:
        assert bool(fell_back) is exclude


def test_without_the_marking_op_a_compiled_checkpoint_recomputes_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A PyTorch without dynamo_bypassing_wrapper (none from 2.9 to 2.14; forced here):
    # compiled, recomp is PyTorch's checkpoint. No graph break, the region is recomputed
    # as under torch's checkpoint, the same gradients, and one warning for all compiles.
    from recomp.errors import ForeignCheckpointWarning
    from recomp.torch import _compat, _compile

    monkeypatch.setattr(_compile, "_BYPASS", None)
    monkeypatch.setitem(_compile._warned, "recomputed", False)
    monkeypatch.setattr(
        _compile, "_warn_recomputed_once", _compat.run_at_trace_time(_compile._warn_recomputed_once)
    )
    x = example()

    def compiled_step(kind: str) -> tuple[list[torch.Tensor], int]:
        torch._dynamo.reset()
        model = make_stack(kind)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        grads_of(model, lambda: compiled(x))  # compiles
        return grads_of(model, lambda: compiled(x)), tally_calls(
            lambda: grads_of(model, lambda: compiled(x))
        )

    torch_grads, torch_runs = compiled_step("torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recomp_grads, recomp_runs = compiled_step("recomp")
        compiled_step("recomp")  # a second compilation: no second warning
    assert recomp_runs == torch_runs == 4  # two layers, each region run twice
    assert_equal(recomp_grads, torch_grads)
    messages = [str(w.message) for w in caught if w.category is ForeignCheckpointWarning]
    assert len(messages) == 1 and "recomputed under torch.compile" in messages[0]


# --------------------------------------------------------------------------- options


def _policy_saving(op_to_save: Any) -> Callable[[], Any]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tuc.CheckpointPolicy:
        if op is op_to_save:
            return tuc.CheckpointPolicy.MUST_SAVE
        return tuc.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(tuc.create_selective_checkpoint_contexts, policy)


def test_selective_checkpoint_policy_composes_compiled() -> None:
    # The user's policy saves matmuls and recomputes everything else, the tally inside
    # the region included; the exclusion overrides it there: the region runs once. The
    # tally outside the region follows the policy: recomputed, it runs twice.
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    region = checkpoint_exclude_wrapper(lambda t: torch.sin(tally(t) @ w))
    context_fn = _policy_saving(torch.ops.aten.mm.default)

    def body(t: torch.Tensor) -> torch.Tensor:
        return torch.cos(tally(region(torch.tanh(t @ w)))) @ w

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(body, x, context_fn=context_fn).sum()

    assert compiled_tally_against_eager(step, w, check_breaks=True) == 1 + 2


def test_save_output_false_chain_compiled() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    first = checkpoint_exclude_wrapper(lambda t: tally(t @ w), save_output=False)
    second = checkpoint_exclude_wrapper(lambda t: torch.sigmoid(tally(t)) @ w)

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(second(first(torch.relu(t)))), x).sum()

    assert compiled_tally_against_eager(step, w) == 2


def test_nested_recomp_checkpoints_compiled() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    region = checkpoint_exclude_wrapper(lambda t: tally(torch.sin(t)) @ w)

    def inner(t: torch.Tensor) -> torch.Tensor:
        return torch.cos(region(t @ w)) @ w

    def outer(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(checkpoint(inner, t)) @ w

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(outer, x).sum()

    assert compiled_tally_against_eager(step, w) == 1


def test_use_reentrant_true_still_raises_compiled() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(torch.sin, x, use_reentrant=True)

    with pytest.raises(ValueError, match="non-reentrant"):
        torch.compile(step, backend="aot_eager")(torch.randn(3, requires_grad=True))


# --------------------------------------------------------------------------- what is saved


class Captured:
    """An aot_eager-like backend that keeps the partitioned forward and backward graphs."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self.saved: list[list[torch.fx.Node]] = []

        def partition(joint: Any, inputs: Any, *, num_fwd_outputs: int, **kw: Any) -> Any:
            fw, bw = min_cut_rematerialization_partition(
                joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw
            )
            outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
            self.saved.append(list(outputs[num_fwd_outputs:]))
            return fw, bw

        def keep(into: list[torch.fx.GraphModule]) -> Any:
            def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
                into.append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = aot_autograd(
            fw_compiler=keep(self.forward), bw_compiler=keep(self.backward), partition_fn=partition
        )

    def saved_activation_bytes(self) -> int:
        """Bytes of the tensors the forward saves for backward, parameters and inputs aside."""
        total = 0
        for node in self.saved[0]:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and node.op != "placeholder":
                total += val.numel() * val.element_size()
        return total

    def backward_ops(self) -> list[str]:
        return [
            str(n.target) for g in self.backward for n in g.graph.nodes if n.op == "call_function"
        ]


class Projection(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class NormMatmulSilu(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.proj = Projection(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(self.norm(x)))


def test_region_input_is_recomputed_not_saved_compiled() -> None:
    # norm -> excluded matmul -> silu: the matmul runs once (no mm recomputed in backward,
    # only its two gradient matmuls), its output is saved (silu's backward reads it), and
    # the norm's output, which the matmul's backward reads, is recomputed from the
    # checkpoint's input instead of being kept: the deferred input of eager recomp.
    hidden = 32
    torch.manual_seed(0)
    layer = NormMatmulSilu(hidden)
    layer.proj = checkpoint_exclude_wrapper(layer.proj)  # type: ignore[assignment]
    model = checkpoint_wrapper(layer)
    x = torch.randn(4, 16, hidden, requires_grad=True)
    capture = Captured()
    torch.compile(model, backend=capture.backend, fullgraph=True)(x).sum().backward()
    ops = capture.backward_ops()
    assert ops.count("aten.mm.default") == 2
    assert "aten.rsqrt.default" in ops  # the norm, recomputed
    one_activation = x.numel() * 4
    # Saved: the matmul output, and the norm's per-row scale (a reduction, 1/hidden of it).
    assert capture.saved_activation_bytes() < 1.1 * one_activation


def test_saves_what_selective_checkpointing_of_the_region_saves() -> None:
    # The same tensors as PyTorch selective checkpointing with a policy that saves every
    # op of the region, as recomp marks them (the policy sees the region through Dynamo's
    # module stack). Views matter: PyTorch 2.9 and 2.13 decompose the attention into ops
    # whose saved views the partitioner then prefers to their bases.
    import torch.fx.traceback as fx_traceback

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tuc.CheckpointPolicy:
        stack = fx_traceback.current_meta.get("nn_module_stack") or {}
        if any(cls is Attention for _path, cls in stack.values()):
            return tuc.CheckpointPolicy.MUST_SAVE
        return tuc.CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, policy)
    x = example()
    recomp_model = make_stack("recomp", layers=1)
    recomp_capture = Captured()
    torch.compile(recomp_model, backend=recomp_capture.backend)(x).sum().backward()

    sac_model = make_stack("none", layers=1)
    sac_model.layers[0] = checkpoint_wrapper(sac_model.layers[0], context_fn=context_fn)
    sac_capture = Captured()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(sac_model, backend=sac_capture.backend)(x).sum().backward()
    full_capture = Captured()
    full_model = make_stack("recomp-full", layers=1)
    torch.compile(full_model, backend=full_capture.backend)(x).sum().backward()

    assert recomp_capture.saved_activation_bytes() == sac_capture.saved_activation_bytes()
    assert full_capture.saved_activation_bytes() < recomp_capture.saved_activation_bytes()


def test_collective_in_a_region_is_not_recomputed() -> None:
    # A row-parallel linear whose all-reduce is excluded: the backward graph holds the
    # collectives of the model without checkpointing, none more. PyTorch's checkpoint
    # around the same block puts the forward all-reduce into the recompute.
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class RowParallel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(self.linear(x), "sum", dist.group.WORLD)

    class ParallelBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.row = RowParallel()
            self.out = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.row(torch.tanh(self.inp(x)))))

    def backward_collectives(kind: str) -> int:
        torch._dynamo.reset()
        block: nn.Module = ParallelBlock()
        if kind == "recomp":
            block.row = checkpoint_exclude_wrapper(block.row)  # type: ignore[assignment]
            block = checkpoint_wrapper(block)
        elif kind == "torch":
            block = PlainCheckpoint(block)
        capture = Captured()
        x = torch.randn(4, 8, requires_grad=True)
        torch.compile(block, backend=capture.backend, fullgraph=True)(x).sum().backward()
        return capture.backward_ops().count("_c10d_functional.all_reduce.default")

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        counts = {kind: backward_collectives(kind) for kind in ("none", "recomp", "torch")}
    finally:
        dist.destroy_process_group()
    assert counts["recomp"] == counts["none"]
    assert counts["torch"] == counts["none"] + 1


# --------------------------------------------------------------------------- random numbers


class DropoutBlock(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.kept = nn.Sequential(nn.Linear(hidden, hidden), nn.Dropout(0.5))
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.kept(self.drop(torch.relu(self.inp(x))))
        return self.out(self.drop(h)) + x


def _dropout_model(kind: str, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(DropoutBlock() for _ in range(blocks)))
    for i in range(blocks):
        if kind == "recomp":
            model[i].kept = checkpoint_exclude_wrapper(model[i].kept)
            model[i] = checkpoint_wrapper(model[i])
        elif kind == "torch":
            model[i] = PlainCheckpoint(model[i])
    return model


def _compiled_dropout_step(
    kind: str, backend: str, blocks: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch._dynamo.reset()
    model = _dropout_model(kind, blocks)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(3)
    out = compiled(x)
    out.sum().backward()
    return out.detach(), [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _check_dropout_matches_torch(backend: str, blocks: int = 2) -> None:
    out_torch, grads_torch = _compiled_dropout_step("torch", backend, blocks)
    out_recomp, grads_recomp = _compiled_dropout_step("recomp", backend, blocks)
    assert torch.equal(out_recomp, out_torch)
    assert_equal(grads_recomp, grads_torch)
    if backend == "aot_eager":
        # Eager random numbers: the seed decides the masks, not the strategy. (Inductor
        # seeds each random op of its own graph, which differs without a checkpoint.)
        out_none, _ = _compiled_dropout_step("none", backend, blocks)
        assert torch.equal(out_torch, out_none)


def test_dropout_matches_torch_checkpoint_compiled() -> None:
    _check_dropout_matches_torch("aot_eager")


# --------------------------------------------------------------------------- inductor

# Inductor may fuse and reorder float sums: gradients agree with eager recomp within
# this tolerance (float32, these sizes), not bit for bit.
INDUCTOR_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def _inductor_in_process() -> Any:
    # Compile in this process: a pool of compile workers costs more to start than it
    # saves on graphs this small.
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


@pytest.mark.inductor
@pytest.mark.usefixtures("_inductor_in_process")
def test_inductor_runs_region_once_with_eager_gradients() -> None:
    model = make_stack("recomp", layers=1)
    x = example()
    eager = grads_of(model, lambda: model(x))
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    grads_of(model, lambda: compiled(x))  # compiles
    assert tally_calls(lambda: grads_of(model, lambda: compiled(x))) == 1
    for got, expected in zip(grads_of(model, lambda: compiled(x)), eager):
        torch.testing.assert_close(got, expected, **INDUCTOR_TOLERANCE)
    # The control: PyTorch's checkpoint around the same layer recomputes the region.
    torch._dynamo.reset()
    control = torch.compile(make_stack("torch", layers=1), backend="inductor", fullgraph=True)
    control(x).sum().backward()
    assert tally_calls(lambda: control(x).sum().backward()) == 2


@pytest.mark.inductor
@pytest.mark.usefixtures("_inductor_in_process")
def test_inductor_dropout_matches_torch_checkpoint() -> None:
    _check_dropout_matches_torch("inductor", blocks=1)


# --------------------------------------------------------------------------- HF Llama


def test_hf_llama_compiles_fullgraph() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, modeling_llama.LlamaDecoderLayer),
        exclude_fn=lambda m: isinstance(m, modeling_llama.LlamaAttention),
    )
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    # Compiling changes the gradients of this model by itself on some PyTorch versions
    # (2.9.1: up to 4.5e-8, without any checkpoint): recomp may differ from eager by
    # that much and no more (on 2.13 and 2.14 by nothing).
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).train()
    plain_eager = grads_of(plain, lambda: loss(plain))
    plain_compiled = grads_of(plain, lambda: loss(torch.compile(plain, backend="aot_eager")))
    torch._dynamo.reset()
    eager = grads_of(model, lambda: loss(model))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = grads_of(model, lambda: loss(compiled))
    for g, e, pc, pe in zip(got, eager, plain_compiled, plain_eager):
        limit = (pc - pe).abs().max().item()
        assert (g - e).abs().max().item() <= limit, limit


# --------------------------------------------------------------------------- benchmark


def test_bench_measures_compiled_strategies() -> None:
    from recomp.cli.bench import build_parser
    from recomp.cli.config import BenchConfig
    from recomp.cli.torch.runner import measure_strategy

    assert build_parser().parse_args(["--compile"]).compile == "inductor"
    assert build_parser().parse_args(["--compile", "aot_eager"]).compile == "aot_eager"
    assert build_parser().parse_args([]).compile is None

    config = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=2, compile="aot_eager")
    rows = [measure_strategy(config, s) for s in ("sac:attn", "exclude:attn")]
    for row in rows:
        assert row.error is None
        assert row.framework == "torch+aot_eager"
        assert row.max_grad_diff < 1e-6  # against eager, no checkpoint
        assert row.activation_bytes > 0
        assert row.forward_flops is None  # not counted inside compiled graphs


# A model recomp never touches, compiled before recomp wraps another one. Its forward
# slices its ModuleList, which registers modules (as HF Llama's forward does): a global
# registration hook of recomp's would run in it and be guarded on.
UNTOUCHED_COMPILE = """
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

class Untouched(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x).relu()
        return x

counter = CompileCounter()
model = torch.compile(Untouched(), backend=counter)
x = torch.randn(2, 8)
model(x).sum().backward()
model(x).sum().backward()
before = counter.frame_count
hooks = len(torch.nn.modules.module._global_module_registration_hooks)

import recomp.torch as rt
other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
other[0] = rt.checkpoint_exclude_wrapper(other[0])
other = rt.checkpoint_wrapper(other)
other(torch.randn(2, 8, requires_grad=True)).sum().backward()
rt.apply_activation_checkpointing(nn.Sequential(nn.Sequential(nn.Linear(8, 8))),
                                  checkpoint_fn=nn.Sequential)

model(x).sum().backward()
assert len(torch.nn.modules.module._global_module_registration_hooks) == hooks
assert counter.frame_count == before, (before, counter.frame_count)
print("ok", before)
"""


def test_a_compiled_model_recomp_never_touched_does_not_recompile_when_recomp_wraps_another():
    """recomp installs nothing global that compiled graphs guard on (a fresh process, so
    that recomp is imported only after the first compile)."""
    import os
    import subprocess
    import sys

    import paths

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(paths.SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", UNTOUCHED_COMPILE], capture_output=True, text=True, env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]
