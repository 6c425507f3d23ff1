"""Offloading an excluded region's kept tensors, tested on CPU in host-copy mode.

Host-copy mode runs the offloader's bookkeeping on CPU tensors (copies into other
CPU tensors, synchronously): what is offloaded, when the original is released,
when it is restored, and that gradients are those of exclusion without offload,
bit for bit. The CUDA streams and events are not exercised here.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils.checkpoint as tuc
from hypothesis import HealthCheck, given, settings
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import random_programs as rp
import recomp.torch as rt
from memory import run_measured
from recomp import _testing
from recomp.errors import CachedValueMutatedError
from recomp.torch import _offload
from torch_models import assert_same_grads, grads_of
from torch_programs import OPS, RegionModule, region_params

D = 16


class Region(nn.Module):
    """linear -> tanh -> linear: keeps tanh's output (saved by tanh and by the second
    linear: one storage), its input (deferred) and the weights (parameters)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.act = nn.Tanh()
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class Layer(nn.Module):
    def __init__(self, d: int = D, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Region(d)
        self.drop = nn.Dropout(p)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.drop(self.attn(self.norm(x)))
        return h + self.mlp(h)


def make(n: int = 3, p: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Layer(p=p) for _ in range(n)])


def host_offloader(min_bytes: int = 0) -> rt.Offloader:
    return rt.Offloader(min_bytes=min_bytes, host_copy=True)


def wrap(model: nn.Sequential, offload, **checkpoint_kwargs) -> nn.Sequential:
    for i, layer in enumerate(model):
        layer.attn = rt.checkpoint_exclude_wrapper(layer.attn, offload=offload)
        model[i] = rt.checkpoint_wrapper(layer, **checkpoint_kwargs)
    return model


def pair(offloader, n=3, p=0.0, **checkpoint_kwargs):
    """Two copies of one model: excluded attention without offload, and with."""
    kept = wrap(make(n, p), False, **checkpoint_kwargs)
    offloaded = wrap(make(n, p), offloader, **checkpoint_kwargs)
    return kept, offloaded


def square_sum(out):
    return out.pow(2).sum()


X_SHAPE = (4, 5, D)
ACT_BYTES = 4 * 5 * D * 4  # one (4, 5, 16) float32 activation


def kept_bytes(model: nn.Module) -> int:
    return sum(m.region_saved_bytes for m in model.modules() if isinstance(m, rt.ExcludeWrapper))


def live(cls) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls)


# --------------------------------------------------------------------------- what


def test_offloads_saved_tensors_and_output_not_inputs_or_parameters():
    off = host_offloader()
    _, model = pair(off, n=3)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    model(x).pow(2).sum().backward()
    # Per layer: tanh's output (one storage for its two saves) and the cached output.
    # Not the region's input (deferred: the replay recomputes it), nor the weights.
    assert off.stats.offloaded_storages == 3 * 2
    assert off.stats.offloaded_bytes == 3 * 2 * ACT_BYTES == kept_bytes(model)
    # Everything came back for the backward, ahead of its read.
    assert off.stats.restored_bytes == off.stats.offloaded_bytes
    assert off.stats.prefetched_bytes == off.stats.restored_bytes
    assert off.pending_copies == 0


def test_restores_run_in_backward_order_one_region_ahead():
    off = host_offloader()
    model = make(3)
    for i, layer in enumerate(model):
        layer.attn = rt.checkpoint_exclude_wrapper(layer.attn, offload=off, name=f"attn{i}")
        model[i] = rt.checkpoint_wrapper(layer)
    with _testing.offload_events(off) as events:
        loss = model(torch.randn(*X_SHAPE)).pow(2).sum()
        assert events == []
        loss.backward()

    def layer(i, chained):
        name = f"attn{i}"
        return [
            ("read", name),  # the replay takes the cached output: the region's first read
            *chained,  # ... starts the region before it (next in backward order)
            ("read", name),  # the second linear's backward reads tanh's output
            ("read", name),  # tanh's backward reads it too
        ]

    # Layer 2's replay reaches attn2 and brings it back; for the others that was done
    # one region earlier, so their replays find everything on the device.
    assert events == [
        *[("copy back", "attn2")] * 2,
        *layer(2, [("copy back", "attn1")] * 2),
        *layer(1, [("copy back", "attn0")] * 2),
        *layer(0, []),
    ], events


def test_a_read_output_is_not_brought_back_again_in_the_same_pass():
    """Both regions of a layer excluded: the replay takes attention's cached output
    (read: every view of it done in this pass), then the MLP's first read brings back the
    region before it, attention, whose output must not be copied back a second time."""
    off = host_offloader()
    model = make(3)
    for i, layer in enumerate(model):
        layer.attn = rt.checkpoint_exclude_wrapper(layer.attn, offload=off, name=f"attn{i}")
        layer.mlp = rt.checkpoint_exclude_wrapper(layer.mlp, offload=off, name=f"mlp{i}")
        model[i] = rt.checkpoint_wrapper(layer)
    groups: list = []  # type: ignore[type-arg]
    off.group_opened = groups.append
    model(torch.randn(*X_SHAPE, requires_grad=True)).pow(2).sum().backward()
    attn = [g for g in groups if g.name.startswith("attn")]
    assert len(attn) == 3
    assert all(g.restored_bytes == g.offloaded_bytes for g in attn), [
        (g.name, g.offloaded_bytes, g.restored_bytes) for g in attn
    ]
    assert off.pending_copies == 0


def test_checkpoint_inputs_stay():
    """A region applied to the checkpoint's own input: the checkpoint holds that input
    anyway, so the region keeps it as it is."""
    off = host_offloader()
    lin = nn.Linear(D, D)
    region = rt.checkpoint_exclude_wrapper(nn.Sequential(lin, nn.Tanh()), offload=off)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    rt.checkpoint(lambda t: region(t) * 2, x).sum().backward()
    # Offloaded: tanh's output (saved by tanh, and the cached output: one storage).
    assert off.stats.offloaded_storages == 1
    assert off.stats.offloaded_bytes == ACT_BYTES


def test_threshold_keeps_small_storages_on_the_device():
    off = host_offloader(min_bytes=ACT_BYTES + 1)
    kept, model = pair(off, n=2)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    _, g_kept = grads_of(kept, square_sum, x)
    _, g = grads_of(model, square_sum, x)
    assert off.stats.offloaded_bytes == 0
    assert_same_grads(g_kept, g)
    off.min_bytes = ACT_BYTES
    grads_of(model, square_sum, x)
    assert off.stats.offloaded_bytes == 2 * 2 * ACT_BYTES


# --------------------------------------------------------------------------- when


@pytest.mark.parametrize("offloading", [False, True])
def test_original_released_after_forward_and_restored_for_backward(offloading):
    """Storage lifetimes: with offload, tanh's output is gone once the forward is over;
    without, the region keeps it until backward."""
    offload = host_offloader() if offloading else False
    model = wrap(make(2), offload)
    refs = []
    inside = []
    for layer in model:
        region = layer.attn  # wrapped in place: still the Region module
        region.act.register_forward_hook(
            lambda m, i, out: refs.append(StorageWeakRef(out.untyped_storage()))
        )
        if offload:
            # Inside the region the copy was made but the original is still held.
            region.b.register_forward_hook(lambda m, i, out: inside.append(offload.pending_copies))
    x = torch.randn(*X_SHAPE, requires_grad=True)
    loss = model(x).pow(2).sum()
    gc.collect()
    if not offload:
        assert not any(r.expired() for r in refs)
        return
    assert inside == [1, 1]
    assert len(refs) == 2 and all(r.expired() for r in refs)
    assert offload.pending_copies == 0
    assert offload.stats.restored_bytes == 0
    loss.backward()
    assert offload.stats.restored_bytes == offload.stats.offloaded_bytes


def test_nothing_is_held_after_backward_or_without_it():
    off = host_offloader()
    _, model = pair(off, n=2)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    model(x).pow(2).sum().backward()
    assert live(_offload._Stored) == 0 and live(_offload.OffloadGroup) == 0
    out = model(x)
    assert live(_offload._Stored) == 4 and live(_offload.OffloadGroup) == 2
    del out  # dropped without backward
    assert live(_offload._Stored) == 0 and live(_offload.OffloadGroup) == 0
    assert off.pending_copies == 0


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("early_stop", [True, False])
def test_gradients_equal_exclusion_without_offload(early_stop):
    off = host_offloader()
    kept, model = pair(off, n=3, p=0.2, early_stop=early_stop)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    for _ in range(2):
        torch.manual_seed(7)
        loss_kept, g_kept = grads_of(kept, square_sum, x)
        torch.manual_seed(7)
        loss, g = grads_of(model, square_sum, x)
        assert torch.equal(loss_kept, loss)
        assert_same_grads(g_kept, g)
    assert off.stats.offloaded_bytes > 0 and off.pending_copies == 0


def test_retain_graph_second_backward_finds_the_tensors():
    off = host_offloader()
    kept, model = pair(off, n=2)
    x = torch.randn(*X_SHAPE)
    results = []
    for m in (kept, model):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in m.parameters()]
        loss.backward()
        results.append((first, [p.grad.clone() for p in m.parameters()]))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        assert torch.equal(a, b)
    assert off.stats.restored_bytes == 2 * off.stats.offloaded_bytes


def test_autocast():
    off = host_offloader()
    kept, model = pair(off, n=2)
    x = torch.randn(*X_SHAPE, requires_grad=True)

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grads_of(m, lambda o: o.float().pow(2).sum(), x)

    loss_kept, g_kept = run(kept)
    loss, g = run(model)
    assert torch.equal(loss_kept, loss)
    assert_same_grads(g_kept, g)
    # In bf16 the region also keeps the casts of its input and weights (new storages,
    # so they are offloaded too): all it keeps, as region_saved_bytes counts it.
    per_layer = 3 * ACT_BYTES // 2 + 2 * D * D * 2
    assert off.stats.offloaded_bytes == 2 * per_layer == kept_bytes(model)


def test_selective_and_nested_checkpoints():
    def policy(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return tuc.CheckpointPolicy.MUST_SAVE if keep else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    def sac():
        return tuc.create_selective_checkpoint_contexts(policy)

    off = host_offloader()
    x = torch.randn(*X_SHAPE, requires_grad=True)
    grads = []
    for offload in (False, off):
        model = wrap(make(2), offload, context_fn=sac)
        outer = rt.checkpoint_wrapper(model)  # nested: each layer is a checkpoint too
        grads.append(grads_of(outer, square_sum, x)[1])
    assert_same_grads(*grads)
    assert off.stats.offloaded_bytes == kept_bytes(outer) > 0
    # The outer replay re-runs the inner checkpoints, whose regions hand out their
    # cached outputs there and again in their own replay: restored once per read.
    assert off.stats.restored_bytes >= off.stats.offloaded_bytes


def test_apply_activation_checkpointing_offload_fn():
    off_layers = make(2)
    rt.apply_activation_checkpointing(
        off_layers,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, (Region, nn.LayerNorm)),
        offload_fn=lambda m: isinstance(m, Region),
    )
    wrappers = [m for m in off_layers.modules() if isinstance(m, rt.ExcludeWrapper)]
    chosen = {
        kind.__name__: w.region.placer
        for w in wrappers
        for kind in (Region, nn.LayerNorm)
        if isinstance(w, kind)
    }
    assert chosen["Region"] is rt.default_offloader()
    assert chosen["LayerNorm"] is None
    with pytest.raises(ValueError, match="no exclude_fn"):
        rt.apply_activation_checkpointing(
            make(1), checkpoint_fn=lambda m: isinstance(m, Layer), offload_fn=lambda m: True
        )


# --------------------------------------------------------------------------- edges


def test_mutation_of_an_offloaded_output_is_caught():
    off = host_offloader()
    region = rt.checkpoint_exclude_wrapper(Region(), offload=off)

    def body(t):
        y = region(torch.sin(t))
        y.mul_(2)  # changes the region's cached output after it returned
        return y.cos()

    x = torch.randn(*X_SHAPE, requires_grad=True)
    with pytest.raises(CachedValueMutatedError):
        rt.checkpoint(body, x).sum().backward()


class Boom(RuntimeError):
    pass


def test_failure_midway_leaves_nothing_behind():
    off = host_offloader()
    fail = [True]

    class Failing(Region):
        def forward(self, x):
            h = self.act(self.a(x))  # saved and offloaded already
            if fail[0]:
                raise Boom
            return self.b(h)

    torch.manual_seed(0)
    region = rt.checkpoint_exclude_wrapper(Failing(), offload=off)
    reference = rt.checkpoint_exclude_wrapper(Failing(), offload=False)
    reference.load_state_dict(region.state_dict())
    x = torch.randn(*X_SHAPE, requires_grad=True)
    with pytest.raises(Boom):
        rt.checkpoint(lambda t: region(torch.sin(t)), x)
    assert off.stats.offloaded_storages == 1  # it did start copying
    assert off.pending_copies == 0
    assert live(_offload._Stored) == 0 and live(_offload.OffloadGroup) == 0
    assert all(ref() is None for ref in off._groups)
    fail[0] = False
    grads = []
    for r in (reference, region):
        x.grad = None
        rt.checkpoint(lambda t, r=r: r(torch.sin(t)), x).pow(2).sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(*grads)


def test_cpu_without_host_copy_is_a_no_op(monkeypatch):
    monkeypatch.delenv(_offload.ENV_HOST_COPY, raising=False)
    off = rt.Offloader(min_bytes=0)
    kept, model = pair(off, n=2, p=0.2)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    torch.manual_seed(3)
    loss_kept, g_kept = grads_of(kept, square_sum, x)
    torch.manual_seed(3)
    loss, g = grads_of(model, square_sum, x)
    assert torch.equal(loss_kept, loss)
    assert_same_grads(g_kept, g)
    assert off.stats == rt.OffloadStats()  # CPU tensors move only in host-copy mode
    if not torch.cuda.is_initialized():
        assert off._groups == []  # and without CUDA nothing is even recorded
    # The environment variable switches the test mode on for the default setting.
    monkeypatch.setenv(_offload.ENV_HOST_COPY, "1")
    grads_of(model, square_sum, x)
    assert off.stats.offloaded_bytes == 2 * 2 * ACT_BYTES


def test_bad_arguments():
    with pytest.raises(ValueError, match="offload must be True, False or"):
        rt.checkpoint_exclude_wrapper(nn.Linear(2, 2), offload="yes")
    with pytest.raises(ValueError, match="min_bytes"):
        rt.Offloader(min_bytes=-1)
    assert "offload=True" in repr(rt.checkpoint_exclude_wrapper(nn.Linear(2, 2), offload=True))


@pytest.mark.system  # a soak of 1000 steps
def test_no_leak_over_1000_steps():
    """Heap and Python objects flat over 1,000 training steps (a child process with one
    malloc arena, see tests/support/memory.py)."""
    result = run_measured(
        """
        import gc, torch, recomp.torch as rt
        from torch import nn
        from recomp.torch import _offload

        def build(offload):
            torch.manual_seed(0)
            layers = []
            for _ in range(2):
                region = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
                blk = nn.Sequential(
                    nn.LayerNorm(32),
                    rt.checkpoint_exclude_wrapper(region, offload=offload),
                    nn.Tanh(),  # saves after the region: the replay needs its output
                )
                layers.append(rt.checkpoint_wrapper(blk))
            return nn.Sequential(*layers)

        def ours():
            return sum(
                type(o) in (_offload._Stored, _offload.OffloadGroup, _offload.OffloadHandle)
                for o in gc.get_objects()
            )

        x = torch.randn(8, 32)

        def train(offload):
            model = build(offload)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            readings = []
            for step in range(1000):
                model(x).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
                if step in (99, 999):
                    gc.collect()
                    readings.append((heap_bytes(), len(gc.get_objects()), ours()))
            return readings

        # The same steps without offloading: what the framework itself grows by (torch
        # 2.13's heap grows slowly on its own), measured in the same process.
        baseline = train(False)
        offload = rt.Offloader(min_bytes=0, host_copy=True)
        readings = train(offload)
        result = {
            "readings": readings,
            "baseline": baseline,
            "moved": offload.stats.offloaded_bytes,
            "restored": offload.stats.restored_bytes,
            "pending": offload.pending_copies,
            "groups": len(offload._groups),
        }
        """
    )
    assert result["moved"] == result["restored"] == 1000 * 2 * 2 * 8 * 32 * 4
    assert result["pending"] == 0 and result["groups"] <= 2
    (heap0, objects0, ours0), (heap1, objects1, ours1) = result["readings"]
    (base0, _, _), (base1, _, _) = result["baseline"]
    assert (heap1 - heap0) - (base1 - base0) < 64 * 1024, result
    assert objects1 - objects0 <= 20, result
    assert ours0 == ours1 == 0, result


# --------------------------------------------------------------------------- random programs


def _run_program(program, offloader):
    """A random program (see random_programs) with recomp, its regions offloading to
    ``offloader`` (None: not offloading); gradients as numpy arrays."""
    xs, ps = rp.initial_values(program)
    inputs = [torch.tensor(x, requires_grad=True) for x in xs]
    params = {n: nn.Parameter(torch.tensor(v)) for n, v in ps.items()}

    def region(r, fn):
        target = RegionModule(fn, region_params(r, params)) if r.as_module else fn
        return rt.checkpoint_exclude_wrapper(
            target, save_output=r.save_output, name=r.name, offload=offloader or False
        )

    runtime = rp.Runtime(OPS, rt.checkpoint, region)
    loss, _, _ = rp.run_program(program, runtime, inputs, params)
    for _ in range(2 if program.backward_twice else 1):
        loss.backward(retain_graph=program.backward_twice)
    grads = {f"input{k}": x.grad for k, x in enumerate(inputs)}
    grads.update({n: p.grad for n, p in params.items()})
    return {k: None if g is None else g.numpy().copy() for k, g in grads.items()}


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=rp.programs())
def test_random_programs_gradients_equal_with_and_without_offload(program):
    """Random programs (regions with pytree inputs and outputs, save_output=False chains,
    nested checkpoints, repeated backwards): offloading changes no gradient bit."""
    off = host_offloader()
    expected = _run_program(program, None)
    actual = _run_program(program, off)
    rp.assert_same_gradients(expected, actual, exact=True)
    assert off.pending_copies == 0


# --------------------------------------------------------------------------- bench


def test_bench_strategy_reports_host_bytes(monkeypatch):
    from recomp.cli.config import BenchConfig
    from recomp.cli.strategies import parse
    from recomp.cli.tables import table
    from recomp.cli.torch.runner import measure_strategy

    assert parse("exclude-offload:attn") == parse("exclude-attn-offload")  # earlier spelling
    assert (parse("exclude-offload:attn").kind, parse("exclude-offload:attn").regions) == (
        "exclude-offload",
        ("attn",),
    )
    config = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=1, warmup=1)
    monkeypatch.delenv(_offload.ENV_HOST_COPY, raising=False)
    plain = measure_strategy(config, "exclude-offload:attn")
    assert plain.offload.host_bytes == 0  # CPU: nothing to do
    monkeypatch.setenv(_offload.ENV_HOST_COPY, "1")
    forced = measure_strategy(config, "exclude-offload:attn")
    # Below the default 1 MiB threshold nothing moves; the bench model's attention
    # keeps 4 KiB storages, so count them with a threshold of 0.
    assert forced.offload.host_bytes == 0
    monkeypatch.setattr(_offload, "DEFAULT_MIN_BYTES", 0)
    forced = measure_strategy(config, "exclude-offload:attn")
    kept = sum(forced.region_saved_bytes.values())
    assert forced.offload.host_bytes == kept > 0
    assert forced.offload.restored_bytes == kept
    assert forced.max_grad_diff == 0.0
    assert forced.region_runs == {"layers.0.attn": 1, "layers.1.attn": 1}
    forced.step_time_s = 1.0
    assert "host MiB/step" in table([forced])
    # How the offload target judges such a row: tests/cli/test_benchmark_targets.py.


# --------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_frees_device_memory_and_keeps_gradients():
    """On a GPU: the real streams and pinned copies. Device memory after the forward
    drops by what the regions keep, gradients stay bit-equal, every restore is a
    prefetch but the first region's in backward order."""
    device = torch.device("cuda")
    d = 256
    x = torch.randn(8, 128, d, device=device)

    def build(offload):
        torch.manual_seed(0)
        model = nn.Sequential(*[Layer(d) for _ in range(4)]).to(device)
        return wrap(model, offload)

    off = rt.Offloader(min_bytes=0)
    results = {}
    for name, offload in (("kept", False), ("offload", off)):
        model = build(offload)
        model(x).pow(2).sum().backward()  # warm-up: kernels, pinned host blocks
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(x).pow(2).sum()
        off.synchronize()
        torch.cuda.synchronize()
        off.poll()
        after_forward = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        results[name] = (after_forward, grads, kept_bytes(model))
    kept_after, kept_grads, kept = results["kept"]
    off_after, off_grads, _ = results["offload"]
    for a, b in zip(kept_grads, off_grads):
        assert torch.equal(a, b)
    assert off.pending_copies == 0
    assert kept_after - off_after == kept, (kept_after, off_after, kept)
    assert off.stats.restored_bytes == off.stats.offloaded_bytes
