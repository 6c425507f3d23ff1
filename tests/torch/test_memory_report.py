"""``recomp.torch.report.saved_tensors_report``: what the autograd graph holds for backward.

The totals are checked against the allocator (glibc's heap, in a child process, as the
benchmark measures activation memory); the per-region sums against ``region_saved_bytes``;
the rest against byte counts that follow from the model's shapes.
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any

import pytest
import torch
from torch import nn

import paths
import recomp.torch as rt
import recomp.torch.report as rr
from memory import run_measured
from recomp._report import (
    CACHED,
    CHECKPOINT_INPUT,
    KEPT,
    OUTSIDE,
    REPLAYED,
    RNG,
    SELECTIVE,
)
from recomp.cli.torch.models import Projection, RMSNorm, norm_matmul_silu
from recomp.torch import _compat

needs_saved_values = pytest.mark.skipif(
    not _compat.saved_values_readable(),
    reason="this PyTorch does not expose saved values without unpacking them",
)

B, T, D = 2, 64, 32
ACT = B * T * D * 4


def _checkpointed(model: nn.Module, exclude: tuple[type, ...] | None) -> nn.Module:
    layers = set(model.layers)
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: m in layers,
        exclude_fn=(lambda m: isinstance(m, exclude)) if exclude else None,
    )
    return model


# --------------------------------------------------------------------------- against the allocator

MEASURE = """
import gc, sys
sys.path.insert(0, {tests!r})
from recomp.cli.config import BenchConfig
from recomp.cli.torch.runner import Trainer
import recomp.torch as rt
import recomp.torch.report as rr
result = {{}}
for model, strategy, hidden, seq in {cases!r}:
    trainer = Trainer(BenchConfig(model=model, layers=2, hidden=hidden, heads=4, seq=seq,
                                  batch=2), strategy)
    for _ in range(2):
        trainer.step()
    gc.collect()
    before = heap_bytes()
    loss = trainer.forward()
    measured = heap_bytes() - before
    report = rr.saved_tensors_report(loss, model=trainer.model, inputs=trainer.x)
    figures = result[model + " " + strategy] = {{
        "measured": measured,
        "total": report.total_bytes,
        "regions": {{k: v for k, v in report.by_region().items() if k}},
        "region_saved_bytes": {{k: w.region_saved_bytes
                                for k, w in trainer.prepared.exclude_wrappers.items()}},
        "deferred": report.deferred_bytes,
    }}
    loss.backward()
    figures["after_backward"] = rr.saved_tensors_report(loss).total_bytes
    del loss, trainer
"""

DECODER = "recomp.cli.torch.models:llama"
HF_LLAMA = "hf_models:tiny_llama"


@needs_saved_values
def test_total_is_the_activation_memory_the_allocator_sees():
    """On the built-in decoder and a Hugging Face Llama, with no, full, selective (the
    decoder) and attention-excluded checkpointing: within 2% of the heap the forward left in use, as the benchmark measures
    it (the rest is autograd's nodes and Python objects). Per-region sums are
    region_saved_bytes, except what two regions share; nothing is left after backward."""

    pytest.importorskip("transformers")
    cases = [(DECODER, s, 256, 512) for s in ("none", "full", "sac:attn", "exclude:attn")]
    cases += [(HF_LLAMA, s, 256, 256) for s in ("none", "exclude:attn")]
    figures = run_measured(MEASURE.format(tests=str(paths.SUPPORT), cases=cases))
    for case, f in figures.items():
        assert abs(f["total"] / f["measured"] - 1) < 0.02, (case, f)
        assert f["after_backward"] == 0, case
        if not case.endswith("exclude:attn"):
            assert f["deferred"] == 0 and not f["regions"], case
            continue
        assert f["deferred"] > 0  # each attention's input, rebuilt by the replay
        assert set(f["regions"]) == set(f["region_saved_bytes"])
        if case.startswith(DECODER):
            assert f["regions"] == f["region_saved_bytes"]
        else:
            # The rotary cos/sin tables are saved by every layer's attention: billed to
            # the first layer's only.
            first, *rest = sorted(f["regions"])
            assert f["regions"][first] == f["region_saved_bytes"][first]
            assert rest and all(f["regions"][n] < f["region_saved_bytes"][n] for n in rest)


# --------------------------------------------------------------------------- exact bytes


@needs_saved_values
def test_deferred_inputs_are_listed_but_not_billed():
    """silu(norm(x) @ W) with the matmul excluded: the matmul's input (the norm's output)
    is rebuilt by the replay: listed as deferred, not billed; the region holds only its
    cached output."""
    layers = 3
    model = _checkpointed(
        norm_matmul_silu(layers, D), (type(norm_matmul_silu(1, D).layers[0].proj),)
    )
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    report = rr.saved_tensors_report(loss, model=model, inputs=x)

    assert [(r.layer, r.region, r.bytes) for r in report.deferred] == [
        (f"layers.{i}", f"layers.{i}.proj", ACT) for i in range(layers)
    ]
    by_region = report.by_region()
    for i in range(layers):
        wrapper = model.layers[i].proj
        assert by_region[f"layers.{i}.proj"] == wrapper.region_saved_bytes == ACT
    kinds = {k: v for k, v in report.by_kind().items() if k != RNG}
    # per layer its cached output; the inputs of layers 1.. (layer 0's is the user's x);
    # outside: the model output, saved by pow.
    assert kinds == {CACHED: layers * ACT, CHECKPOINT_INPUT: (layers - 1) * ACT, OUTSIDE: ACT}
    assert not [r for r in report.rows if r.kind == KEPT]  # W is a parameter
    loss.backward()
    assert rr.saved_tensors_report(loss).rows == []


class NormedLayer(nn.Module):
    """silu(norm(x) @ W) with the matmul excluded; the norm a BatchNorm (whose running
    statistics the replay must leave as it found them: recomp composes a context of its
    own for that) or an RMSNorm."""

    def __init__(self, batch_norm: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(T) if batch_norm else RMSNorm(D)
        self.proj = Projection(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.proj(self.norm(x)))


@needs_saved_values
@pytest.mark.parametrize("extra", ["running statistics", "context_fn"])
def test_regions_are_found_whatever_contexts_the_checkpoint_composes(extra):
    """recomp's record of a checkpoint call (cached outputs, the layer of a deferred
    input) is found under composed contexts too: a BatchNorm's, a user's context_fn."""
    model = nn.Sequential(*(NormedLayer(extra == "running statistics") for _ in range(2)))
    options = {}
    if extra == "context_fn":
        options["context_fn"] = lambda: (contextlib.nullcontext(), contextlib.nullcontext())
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, NormedLayer),
        exclude_fn=lambda m: isinstance(m, Projection),
        **options,
    )
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    report = rr.saved_tensors_report(loss, model=model, inputs=x)
    for i in range(2):  # its cached output; its input (the norm's output) is deferred
        assert report.by_region()[f"{i}.proj"] == model[i].proj.region_saved_bytes == ACT
    assert [(r.layer, r.kind) for r in report.rows if r.region == "1.proj"] == [("1", CACHED)]
    assert [(r.layer, r.region) for r in report.deferred] == [("0", "0.proj"), ("1", "1.proj")]
    loss.backward()


class _TorchCheckpointed(nn.Module):
    def __init__(self, inner: nn.Module, **options: Any) -> None:
        super().__init__()
        self.inner = inner
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False, **self.options)


@needs_saved_values
@pytest.mark.parametrize("by", ["torch", "recomp"])
def test_what_selective_checkpoints_keep_is_billed(by):
    """Selective checkpointing keeps the outputs its policy saves in a cache of its own,
    outside the autograd graph: each layer's matmul output here, billed to its layer.
    Under PyTorch's checkpoint, and under recomp's (which composes the contexts)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(
        create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    model = norm_matmul_silu(3, D)
    if by == "torch":
        for i, layer in enumerate(model.layers):
            model.layers[i] = _TorchCheckpointed(layer, context_fn=context_fn)
    else:
        layers = set(model.layers)
        rt.apply_activation_checkpointing(
            model, checkpoint_fn=lambda m: m in layers, context_fn=context_fn
        )
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    report = rr.saved_tensors_report(loss, model=model, inputs=x)
    kept = [(r.layer, r.op, r.bytes) for r in report.rows if r.kind == SELECTIVE]
    suffix = ".inner" if by == "torch" else ""  # the module the checkpoint runs
    assert kept == [(f"layers.{i}{suffix}", "mm", ACT) for i in range(3)]
    assert report.by_kind()[CHECKPOINT_INPUT] == 2 * ACT  # layers 1 and 2
    loss.backward()
    assert rr.saved_tensors_report(loss).rows == []


class TwoReaders(nn.Module):
    """Two excluded linears that both save the layer input (a checkpoint input: kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).tanh() + self.b(x).tanh()


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TwoReaders() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@needs_saved_values
def test_a_storage_two_regions_keep_is_billed_once():
    model = Stack(2)
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, TwoReaders),
        exclude_fn=lambda m: isinstance(m, nn.Linear),
    )
    x = torch.randn(B, T, D)
    h = torch.randn(B, T, D, requires_grad=True)
    loss = model(h * x).sum()  # h * x: the first layer's input, made in the forward
    report = rr.saved_tensors_report(loss, model=model, inputs=(x, h))
    regions = report.by_region()
    for i in range(2):
        a, b = model.layers[i].a, model.layers[i].b
        # each keeps the shared input and caches its output
        assert a.region_saved_bytes == b.region_saved_bytes == 2 * ACT
        assert regions[f"layers.{i}.a"] + regions[f"layers.{i}.b"] == 3 * ACT
    inputs = [r for r in report.rows if r.kind == CHECKPOINT_INPUT]
    assert inputs == []  # billed to the region that keeps it
    shared = [r for r in report.rows if r.kind == KEPT and r.shape == (B * T, D)]
    assert len(shared) == 2  # once per layer, not once per region


class BiasAttention(nn.Module):
    """Returns its output and a bias it makes when not given one (as T5's first
    self-attention makes the position bias every later layer receives and returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, bias=None):
        if bias is None:
            bias = x.detach().pow(2)  # a new storage, made in the first layer only
        return self.lin(x).tanh() + bias, bias


class BiasLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = BiasAttention()

    def forward(self, x, bias=None):
        out, bias = self.attn(x, bias)
        return out.sin(), bias


class BiasStack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BiasLayer() for _ in range(layers))

    def forward(self, x):
        bias = None
        for layer in self.layers:
            x, bias = layer(x, bias)
        return x


@needs_saved_values
def test_a_storage_several_layers_hold_is_billed_to_the_first():
    """The bias every layer's region returns is cached by each of them: billed once, to
    the layer that made it, whatever order the graph walk meets the layers in."""
    model = BiasStack(3)
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, BiasLayer),
        exclude_fn=lambda m: isinstance(m, BiasAttention),
    )
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    report = rr.saved_tensors_report(loss, model=model, inputs=x)
    regions = report.by_region()
    # each keeps its input (linear) and tanh's output, and caches its output and the bias
    assert [layer.attn.region_saved_bytes for layer in model.layers] == [4 * ACT] * 3
    # layer 0's input is the caller's x; layers 1 and 2 hold the bias layer 0 made
    assert [regions[f"layers.{i}.attn"] for i in range(3)] == [3 * ACT] * 3
    cached = [
        len([r for r in report.rows if r.kind == CACHED and r.layer == f"layers.{i}"])
        for i in range(3)
    ]
    assert cached == [2, 1, 1]
    loss.backward()


class _Cache:
    """A plain object holding tensors (as a KV cache does), not a pytree node."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.layers = [{"keys": t} for t in tensors]


class KeywordLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, pair=None, cache=None):
        return self.lin(x).tanh()


class KeywordStack(nn.Module):
    """Layers that receive their input by keyword, a tuple and a cache object."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(KeywordLayer() for _ in range(layers))

    def forward(self, x: torch.Tensor, by_partial: bool = False) -> torch.Tensor:
        h = x.exp()
        for layer in self.layers:
            pair, cache = (h.sin(),), _Cache([h.cos()])
            if by_partial:  # as Hugging Face's own checkpointing binds keyword arguments
                h = torch.utils.checkpoint.checkpoint(
                    functools.partial(layer.__call__, pair=pair, cache=cache),
                    h,
                    use_reentrant=False,
                )
            else:
                h = layer(x=h, pair=pair, cache=cache)
        return h


@needs_saved_values
@pytest.mark.parametrize("by_partial", [False, True])
def test_arguments_a_checkpoint_holds_as_they_are_are_billed(by_partial):
    """A checkpoint keeps its keyword arguments, its positional arguments that are not
    tensors (a tuple, a cache object) and what a partial binds, as they are, until its
    replay: every tensor in them is billed as a checkpoint input, once, named by its
    parameter; the caller's input is not."""
    model = KeywordStack(2)
    if not by_partial:
        rt.apply_activation_checkpointing(
            model, checkpoint_fn=lambda m: isinstance(m, KeywordLayer)
        )
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x, by_partial).pow(2).mean()
    report = rr.saved_tensors_report(loss, model=model, inputs=x)
    kinds = {k: v for k, v in report.by_kind().items() if k != RNG}
    # per layer: its input, the tuple's tensor and the cache's; outside: the output (pow)
    assert kinds == {CHECKPOINT_INPUT: 2 * 3 * ACT, OUTSIDE: ACT}
    inputs = [(r.layer, r.op) for r in report.rows if r.kind == CHECKPOINT_INPUT]
    names = {"input" if by_partial else "input x", "input pair", "input cache"}
    assert len(inputs) == 6 and {op for _, op in inputs} == names
    assert {layer for layer, _ in inputs} == {"layers.0", "layers.1"}
    loss.backward()
    assert rr.saved_tensors_report(loss).rows == []


@needs_saved_values
def test_without_any_checkpoint():
    """A plain model: every saved activation billed once as saved outside checkpoints;
    the parameters and the caller's input are not."""
    lin = nn.Linear(D, D)
    x = torch.randn(B, T, D, requires_grad=True)
    y = lin(x).sin()  # linear saves x and W (not billed); sin saves lin(x)
    loss = (y * y).sum()  # mul saves y twice: one storage
    report = rr.saved_tensors_report(loss, model=lin, inputs=x)
    assert [(r.kind, r.op, r.bytes) for r in report.rows] == [
        (OUTSIDE, "sin", ACT),
        (OUTSIDE, "mul", ACT),
    ]
    assert report.total_bytes == 2 * ACT
    assert "total held for backward" in str(report)


@needs_saved_values
def test_a_long_table_points_to_the_summary(capsys):
    x = torch.randn(4, 8, requires_grad=True)
    h = x
    for _ in range(120):  # each tanh saves its output: 120 storages
        h = h.tanh()
    loss = h.sum()
    report = rr.print_saved_tensors_report(loss, inputs=x)
    table = capsys.readouterr().out
    assert len(report.rows) == 120 and report.total_bytes == 120 * 4 * 8 * 4
    assert "(120 rows: summary() gives one line per layer" in table
    assert "rows:" not in report.format(max_rows=10)
    rr.print_saved_tensors_report(loss, inputs=x, summary=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["-", "-", "saved", "outside", "checkpoints", "120", "15360"]
    with pytest.raises(TypeError, match="no format options"):
        rr.print_saved_tensors_report(loss, summary=True, max_rows=3)


@needs_saved_values
def test_label_layers_names_the_layers_of_a_model_without_checkpoints():
    model = norm_matmul_silu(3, D)
    x = torch.randn(B, T, D)
    plain = rr.saved_tensors_report(model(x).pow(2).mean(), model=model, inputs=x)
    with rr.label_layers(model, ["layers.0", "layers.1", "layers.2"]):
        loss = model(x).pow(2).mean()
    assert not model.layers[0]._forward_pre_hooks and not model.layers[0]._forward_hooks
    report = rr.saved_tensors_report(loss, model=model, inputs=x)
    assert report.total_bytes == plain.total_bytes
    layers = report.by_layer()
    assert list(layers) == ["layers.0", "layers.1", "layers.2", None]  # forward order
    # Each layer saves x * scale, the norm's output and the matmul's output; layers 1 and 2
    # also their input (pow, mul) and the rsqrt's result (the caller's x needs no grad, so
    # layer 0's norm statistics are not recorded). Outside: the output, saved by pow.
    later = 4 * ACT + B * T * 4
    assert layers == {"layers.0": 3 * ACT, "layers.1": later, "layers.2": later, None: ACT}
    assert {r.kind for r in report.rows} == {OUTSIDE}
    loss.backward()


@needs_saved_values
def test_inside_a_replay():
    """Taken while layer 0 replays (from a forward hook during backward): layer 1's
    backward has run (its rows are gone), layer 0 still holds what it held, plus the
    replay's tensors; taking the report replays nothing."""
    model = _checkpointed(norm_matmul_silu(2, D), (type(norm_matmul_silu(1, D).layers[0].proj),))
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    before = rr.saved_tensors_report(loss, model=model, inputs=x)
    taken = []

    def hook(module, args, out):  # registered after the forward: runs in the replay only
        taken.append(rr.saved_tensors_report(loss, model=model, inputs=x))

    handle = model.layers[0].norm.register_forward_hook(hook)
    loss.backward()
    handle.remove()
    assert len(taken) == 1  # one replay of layer 0: the report itself replayed nothing
    assert taken, "the hook did not see layer 0's replay"
    during = taken[0]
    layer0 = [r for r in before.rows if r.layer == "layers.0" and r.kind != CHECKPOINT_INPUT]
    still = [r for r in during.rows if r.layer == "layers.0" and r.kind != REPLAYED]
    assert sorted(still, key=repr) == sorted(layer0, key=repr)
    assert not [r for r in during.rows if r.layer == "layers.1"]
    assert [r for r in during.rows if r.kind == REPLAYED and r.layer == "layers.0"]
    assert rr.saved_tensors_report(loss).rows == []


@needs_saved_values
def test_after_a_backward_that_retains_the_graph():
    """The replay bound each deferred input (the norm's output) for the excluded matmul's
    backward; the region holds it until the next replay rebinds it: billed as replayed,
    no longer listed as not held. The rest is as before the backward."""
    model = _checkpointed(norm_matmul_silu(2, D), (type(norm_matmul_silu(1, D).layers[0].proj),))
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    before = rr.saved_tensors_report(loss, model=model, inputs=x)
    assert before.deferred_bytes == 2 * ACT
    loss.backward(retain_graph=True)
    after = rr.saved_tensors_report(loss, model=model, inputs=x)
    assert after.deferred == []
    bound = [(r.layer, r.region, r.op) for r in after.rows if r.kind == REPLAYED and r.bytes == ACT]
    assert bound == [(f"layers.{i}", f"layers.{i}.proj", "mm") for i in range(2)]
    assert sum(r.bytes for r in after.rows if r.kind != REPLAYED) == before.total_bytes
    loss.backward()
    assert rr.saved_tensors_report(loss).rows == []


@needs_saved_values
def test_between_split_backward_passes():
    """After an input-gradient pass over a retained graph (as zero-bubble pipeline
    schedules run it), what the replay recomputed for the weight passes is held by
    recomp; the report bills it as replayed, to its layer, and the checkpoint's own
    rows are still found through the kept-replay unpack hook."""
    model = _checkpointed(norm_matmul_silu(2, D), (type(norm_matmul_silu(1, D).layers[0].proj),))
    x = torch.randn(B, T, D, requires_grad=True)
    loss = model(x).pow(2).mean()
    before = rr.saved_tensors_report(loss, model=model, inputs=x)
    torch.autograd.grad(loss, [x], retain_graph=True)
    between = rr.saved_tensors_report(loss, model=model, inputs=x)
    replayed = [r for r in between.rows if r.kind == REPLAYED]
    assert replayed and {r.layer for r in replayed} == {"layers.0", "layers.1"}
    kinds = {r.kind for r in before.rows}
    assert kinds <= {r.kind for r in between.rows}  # inputs and kept regions still found
    torch.autograd.grad(loss, list(model.parameters()))
    # the weight pass read and dropped them (what nodes the weight pass does not run
    # read stays, small here, until the graph goes)
    after = rr.saved_tensors_report(loss).by_kind().get(REPLAYED, 0)
    assert after < sum(r.bytes for r in replayed) / 20


@needs_saved_values
def test_offloaded_tensors_are_billed_as_host_copies():
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.sin()).tanh()

    layer = Layer()
    offloader = rt.Offloader(host_copy=True, min_bytes=1)
    layer.lin = rt.checkpoint_exclude_wrapper(layer.lin, offload=offloader)
    layer = rt.checkpoint_wrapper(layer)
    x = torch.randn(B, T, D, requires_grad=True)
    loss = layer(x).sum()
    report = rr.saved_tensors_report(loss, model=layer, inputs=x)
    host = [r for r in report.rows if r.region == "lin"]
    assert host and all(r.kind == "offloaded (host)" for r in host)
    assert sum(r.bytes for r in host) == layer.lin.region_saved_bytes == ACT  # the output
    assert report.deferred_bytes == ACT  # sin(x), rebuilt by the replay
    loss.backward()


# --------------------------------------------------------------------------- OOM report


@needs_saved_values
def test_oom_report_names_the_running_region_and_lists_largest_first():
    model = _checkpointed(norm_matmul_silu(2, D), (type(norm_matmul_silu(1, D).layers[0].proj),))
    out = io.StringIO()
    with rr.install_oom_report(model, file=out, max_rows=3) as handle:
        # The allocator would call this when an allocation fails inside layer 1's matmul.
        def inside(module, args, result):
            handle.on_out_of_memory(0, 1 << 30, 2 << 30, 0)

        hook = model.layers[1].proj.register_forward_hook(inside)
        loss = model(torch.randn(B, T, D, requires_grad=True)).sum()
        hook.remove()
    message = handle.last_message
    assert handle.attached is torch.cuda.is_available()  # the allocator's observer
    assert message is not None and message == out.getvalue().strip("\n")
    assert "excluded region 'layers.1.proj'" in message
    assert "inside a recomp checkpoint's forward" in message
    lines = message.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("layer ")))
    sizes = [int(line.split()[-1]) for line in lines[start + 2 : start + 5]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == ACT
    # removed: module outputs are no longer tracked
    model(torch.randn(B, T, D, requires_grad=True))
    assert handle.roots == {}
    loss.backward()


def test_report_needs_a_pytorch_that_exposes_saved_values(monkeypatch):
    """Where PyTorch can (2.14), pretend it cannot; where it cannot (2.9), for real."""
    monkeypatch.setattr(_compat, "saved_values_readable", lambda: False)
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="Upgrade PyTorch"):
        rr.saved_tensors_report(x.sin().sum())


# --------------------------------------------------------------------------- the command


@needs_saved_values
def test_report_command_prints_the_table_and_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from recomp.__main__ import main

    png = tmp_path / "report.png"
    args = ["report", "--layers", "2", "--hidden", "64", "--seq", "32", "--png", str(png)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "layers.1.attn" in text and "total held for backward" in text
    assert png.stat().st_size > 0
    # Usage errors stop the command as the line is read (argparse's exit status 2).
    with pytest.raises(SystemExit) as stopped:
        main(["report", "--layers", "1", "--strategy", "nonsense"])
    assert stopped.value.code == 2
    assert "unknown strategy 'nonsense' (did you mean none?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        main(["report", "--model", "no_such_module_here:build"])
    assert stopped.value.code == 2
    assert "no module 'no_such_module_here'" in capsys.readouterr().err
    assert main(["report", "--model", "recomp.cli.torch.models:no_such_factory"]) == 2
    assert "has no 'no_such_factory'" in capsys.readouterr().err
    assert main([*args[:7], "--strategy", "none", "--summary"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # without a checkpoint, label_layers still names each layer
    assert [ln.split()[0] for ln in lines[3:6]] == ["layers.0", "layers.1", "-"]


@needs_saved_values
def test_bench_report_writes_each_strategy(tmp_path):
    pytest.importorskip("matplotlib")
    from recomp.cli.config import BenchConfig
    from recomp.cli.saved_tensors import write_strategy_reports

    config = BenchConfig(layers=1, hidden=32, heads=2, seq=16, batch=1)
    written = write_strategy_reports(str(tmp_path), config, ["full", "plan@50%"])
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == [
        "report-full.png",
        "report-full.txt",
        "report-plan_50_.png",
        "report-plan_50_.txt",
    ]
    assert "total held for backward" in (tmp_path / "report-full.txt").read_text()
