"""The offload session (``recomp.torch.offload_session``, HyperParallel's ``OffloadConfig``,
``OffloadSession``, ``skip_offload``), on CPU in the offloader's host-copy mode.

Host-copy mode runs the session's moves on CPU tensors (copies into other CPU tensors,
synchronously), so bytes moved each way and the bytes the session holds are exact and
asserted. Gradients are compared bit for bit with the model run without the session
(and with the checkpointed model without it). The CUDA streams, events and pinned
memory are exercised by benchmarks/offload_session.py on a device.

Adapted from HyperParallel's tests (``tests/ut/auto_parallel/hyper_offload/``): the
config's defaults and equality, the session's lifecycle (warmup, then replay; the
session itself returned; the active session), an exception in warmup, the host
memory plumbed into the pool, and ``skip_offload`` (name kept, a TypeError for a
non-callable, direct call outside a session, nesting, gradients through it, more or
fewer ops inside it in a later step). Not applicable: their executor, shadow-tensor,
residency-manager, tracker and timer tests test a dispatch-mode runtime recomp does
not have (it works on saved tensors), and their bandwidth test profiles a device.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import recomp.torch as rt  # noqa: E402
from recomp.errors import (  # noqa: E402
    CachedValueMutatedError,
    OffloadTraceWarning,
    RecompError,
)
from recomp.torch._offload import ENV_HOST_COPY  # noqa: E402
from recomp.torch.hyperparallel import OffloadConfig, OffloadSession, skip_offload  # noqa: E402

K = 1024
KIB_FLOATS = K // 4


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setenv(ENV_HOST_COPY, "1")


def exp_step(session, sizes_kib, *, before_backward=None):
    """One step whose saves are known: x_i.exp() saves its output (sizes_kib[i] KiB),
    and backward reads them last first."""
    xs = [torch.randn(k * KIB_FLOATS, requires_grad=True) for k in sizes_kib]
    with session:
        loss = sum(x.exp().sum() for x in xs)
        if before_backward is not None:
            before_backward()
        loss.backward()
    for x in xs:
        assert torch.equal(x.grad, x.detach().exp())
    return session.last_step


# --------------------------------------------------------------------------- bytes


def test_bytes_moved_each_way_are_exact(host):
    # Sizes 4, 1, 2, 8, 1 KiB against an 8 KiB budget. Warmup, oldest first: the 8 KiB
    # save pushes the session to 15 KiB and moves 4, 1 and 2; the last save moves the
    # 8 KiB one. Backward copies all four back when it reads them.
    session = rt.offload_session(8 * K, min_bytes=0)
    first = exp_step(session, [4, 1, 2, 8, 1])
    assert first.mode == "warmup" and session.mode == "replay"
    assert first.saved_bytes == 16 * K
    assert first.offloaded_bytes == first.restored_bytes == first.on_demand_bytes == 15 * K
    assert first.unplanned_evictions == 4 and first.unhidden_copies == 4
    assert first.peak_resident_bytes == 15 * K  # the budget plus the tensor just saved
    assert first.peak_resident_bytes <= 8 * K + 8 * K
    # The plan moves the same four (none can stay), the two smaller ones brought back
    # ahead, the 2 and 8 KiB ones when read (ahead, they would pass the budget).
    plan = session.plan
    assert sorted(plan.decisions) == [0, 1, 2, 3] and plan.moved_bytes == 15 * K
    for _ in range(2):
        step = exp_step(session, [4, 1, 2, 8, 1])
        assert step.mode == "replay" and step.mismatch is None
        assert step.offloaded_bytes == step.restored_bytes == 15 * K
        assert step.prefetched_bytes == 5 * K and step.on_demand_bytes == 10 * K
        assert step.unhidden_copies == 2 and step.unplanned_evictions == 0
        assert step.peak_resident_bytes == 8 * K
        assert step.over_budget_bytes == 0
    assert session.offloader.stats.offloaded_bytes == 45 * K
    assert session.offloader.pending_copies == 0


def test_within_the_budget_nothing_moves(host):
    session = rt.offload_session(64 * K, min_bytes=0)
    for _ in range(2):
        step = exp_step(session, [4, 1, 2])
        assert step.offloaded_bytes == step.restored_bytes == 0
        assert step.peak_resident_bytes == 7 * K
    assert session.plan.decisions == {}


def test_small_tensors_stay(host):
    session = rt.offload_session(0, min_bytes=2 * K)
    step = exp_step(session, [4, 1, 2, 1])
    assert step.offloaded_bytes == 6 * K  # the 1 KiB ones stay
    assert "smaller than min_offload_bytes" in str(session.plan)


def test_without_a_device_nothing_moves_but_the_plan_is_made(monkeypatch):
    monkeypatch.delenv(ENV_HOST_COPY, raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device moves tensors")
    session = rt.offload_session(2 * K, min_bytes=0)
    step = exp_step(session, [4, 1, 2])
    assert step.offloaded_bytes == 0 and step.peak_resident_bytes == 7 * K
    assert step.over_budget_bytes == 5 * K
    assert "no CUDA device" in str(session.plan)


# --------------------------------------------------------------------------- gradients


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * d, d))  # fmt: skip

    def forward(self, x):
        h = x + self.attn(self.norm(x))
        return h + self.mlp(h)


def model(n=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(n)])


def checkpointed(m):
    m = copy.deepcopy(m)
    rt.apply_activation_checkpointing(m, checkpoint_fn=Block, exclude_fn="*.attn")
    return m


def grads(m, x, ctx, seed=1):
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)  # dropout draws the same masks in every run
    with ctx:
        m(x).square().mean().backward()
    return [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]


def assert_equal(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("budget", [0, 24 * K, 1 << 30])
def test_gradients_equal_the_model_without_the_session(host, budget):
    plain = model()
    x = torch.randn(16, 32)
    reference = grads(plain, x, contextlib.nullcontext())
    session = rt.offload_session(budget, min_bytes=0)
    for seed in (1, 1, 2):  # warmup, replay, replay with other dropout masks
        reference = grads(plain, x, contextlib.nullcontext(), seed)
        assert_equal(grads(plain, x, session, seed), reference)
        largest = max(s.nbytes for s in session.trace.storages)
        assert session.last_step.peak_resident_bytes <= budget + largest
    if budget < 1 << 30:
        assert session.last_step.offloaded_bytes > 0


def test_checkpoints_and_excluded_regions_keep_their_tensors_through_the_session(host):
    plain = model()
    wrapped = checkpointed(plain)
    x = torch.randn(16, 32)
    reference = grads(plain, x, contextlib.nullcontext())
    assert_equal(grads(wrapped, x, contextlib.nullcontext()), reference)
    session = rt.offload_session(0, min_bytes=0)
    for _ in range(3):
        assert_equal(grads(wrapped, x, session), reference)
    step = session.last_step
    # A budget of 0 moves everything that may move: each storage once out, once back.
    assert step.offloaded_bytes == step.restored_bytes == step.saved_bytes > 0
    labels = [s.label for s in session.trace.storages]
    assert sum("a checkpoint's inputs" in label for label in labels) == 3
    assert sum(".attn" in label for label in labels) >= 3  # what each excluded region keeps
    # Recomputed code saves nothing through the session: only what is kept is traced.
    plain_session = rt.offload_session(0, min_bytes=0)
    grads(plain, x, plain_session)
    assert step.saved_bytes < plain_session.last_step.saved_bytes


def test_what_a_region_keeps_of_its_checkpoint_s_input_moves_with_it(host):
    """An excluded region whose first op saves the checkpoint's own input keeps it in the
    session's record of that input: once the session moves it, its storage is freed (a
    weak reference to the storage object, which lives as long as the memory, dies); a
    device alias kept by the region would hold it."""
    region = rt.checkpoint_exclude_wrapper(nn.Sequential(nn.Linear(32, 64), nn.Tanh()))
    block = rt.checkpoint_wrapper(nn.Sequential(region, nn.Linear(64, 32)))
    x = torch.randn(16, 32, requires_grad=True)
    session = rt.offload_session(0, min_bytes=0)
    for _ in range(2):
        with session:
            h = x * 2  # an activation: the checkpoint's input, saved by the region's linear
            ref = weakref.ref(h.untyped_storage())
            out = block(h).sum()
            del h
            gc.collect()
            freed = ref() is None
            out.backward()
        assert freed
    labels = [s.label for s in session.trace.storages]
    assert sum("a checkpoint's inputs" in label for label in labels) == 1


def test_hyperparallel_checkpoints_under_the_session(host):
    import recomp.torch.hyperparallel as hp

    plain = model()
    wrapped = copy.deepcopy(plain)
    for i, block in enumerate(wrapped):
        block.attn = hp.checkpoint_exclude_wrapper(block.attn)
        wrapped[i] = hp.checkpoint_wrapper(block)  # early_stop=True, HyperParallel's default
    x = torch.randn(16, 32)
    reference = grads(plain, x, contextlib.nullcontext())
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.01, min_offload_bytes=0))
    for _ in range(2):
        assert_equal(grads(wrapped, x, session), reference)
    assert session.last_step.mode == "replay" and session.last_step.offloaded_bytes > 0


def test_a_region_s_own_offload_and_a_swapped_layer_keep_their_places(host):
    # offload=True on a region and swap_wrapper's hooks are inner to the session's: they
    # decide for their tensors; the session takes the rest. Gradients stay exact.
    plain = model()
    wrapped = copy.deepcopy(plain)
    own = rt.Offloader(min_bytes=0)
    wrapped[0].attn = rt.checkpoint_exclude_wrapper(wrapped[0].attn, offload=own, name="own")
    wrapped[0] = rt.checkpoint_wrapper(wrapped[0])
    wrapped[1] = rt.swap_wrapper(wrapped[1])
    wrapped[2].attn = rt.checkpoint_exclude_wrapper(wrapped[2].attn, name="theirs")
    wrapped[2] = rt.checkpoint_wrapper(wrapped[2])
    x = torch.randn(16, 32)
    reference = grads(plain, x, contextlib.nullcontext())
    session = rt.offload_session(0, min_bytes=0)
    for _ in range(2):
        before = own.stats.offloaded_bytes
        assert_equal(grads(wrapped, x, session), reference)
        assert own.stats.offloaded_bytes > before  # the region's own offloader moved its part
    regions = {s.label.rpartition(" in ")[2] for s in session.trace.storages}
    assert "theirs" in regions and "own" not in regions
    assert sum(" in a checkpoint's inputs" in s.label for s in session.trace.storages) == 2
    assert session.last_step.offloaded_bytes > 0


def test_a_second_backward_brings_the_tensors_back_again(host):
    session = rt.offload_session(0, min_bytes=0)
    x = torch.randn(4 * KIB_FLOATS, requires_grad=True)
    with session:
        y = x.exp()
        loss = (y * y).sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
    assert torch.equal(x.grad, 2 * first)
    assert session.last_step.restored_bytes == 2 * session.last_step.offloaded_bytes


def test_backward_after_the_block_is_planned_at_the_next_entry(host):
    session = rt.offload_session(4 * K, min_bytes=0)
    xs = [torch.randn(k * KIB_FLOATS, requires_grad=True) for k in (4, 4, 1)]
    with session:
        loss = sum(x.exp().sum() for x in xs)
    assert session.plan is None  # backward has not read what the step saved
    loss.backward()
    for x in xs:
        assert torch.equal(x.grad, x.detach().exp())
    step = exp_step(session, [4, 4, 1])
    assert session.plan is not None and step.mode == "replay"
    assert step.peak_resident_bytes <= 4 * K


def test_a_tensor_changed_in_place_after_its_save_raises(host):
    for budget in (0, 1 << 20):  # moved to the host, and kept on the device
        session = rt.offload_session(budget, min_bytes=0)
        x = torch.randn(KIB_FLOATS, requires_grad=True)
        with pytest.raises(CachedValueMutatedError, match="changed in place"), session:
            y = x.exp()
            z = y.sum()
            y.mul_(2)
            z.backward()


# --------------------------------------------------------------------------- kept collectives


@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning")
def test_kept_collectives_under_the_session(host, tmp_path):
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        calls = []

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "allreduce" in str(func):
                    calls.append(func)
                return func(*args, **(kwargs or {}))

        def body(h):
            h = torch.tanh(h)
            dist.all_reduce(h)  # a sum over one rank: h itself
            return h.exp()

        x = torch.randn(8 * KIB_FLOATS, requires_grad=True)
        torch.tanh(x).exp().sum().backward()
        reference = x.grad.clone()
        session = rt.offload_session(0, min_bytes=0)
        for _ in range(2):
            x.grad = None
            calls.clear()
            with session, Count():
                rt.checkpoint(body, x).sum().backward()
            assert torch.equal(x.grad, reference)
            assert len(calls) == 1  # the replay read the kept result
        assert session.last_step.offloaded_bytes > 0
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- a changed step


def test_a_step_with_other_shapes_leaves_the_plan_then_is_traced_again(host):
    session = rt.offload_session(8 * K, min_bytes=0)
    exp_step(session, [4, 1, 2, 8, 1])
    with pytest.warns(OffloadTraceWarning, match=r"save #1 is a float32\[512\] tensor on cpu, "
                      r"where the traced step's is a float32\[256\]"):  # fmt: skip
        step = exp_step(session, [4, 2, 2, 8, 1])
    assert step.mode == "online" and "save #1" in step.mismatch
    assert step.peak_resident_bytes <= 8 * K + 8 * K  # the budget still holds
    assert session.mode == "warmup"
    traced = exp_step(session, [4, 2, 2, 8, 1])
    assert traced.mode == "warmup" and session.mode == "replay"
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadTraceWarning)
        again = exp_step(session, [4, 2, 2, 8, 1])
    assert again.mode == "replay" and again.peak_resident_bytes <= 8 * K


def test_a_step_with_fewer_saves_is_detected_at_its_end(host):
    session = rt.offload_session(8 * K, min_bytes=0)
    exp_step(session, [4, 1, 2, 8, 1])
    with pytest.warns(OffloadTraceWarning, match="it saved 4 tensors, the traced step 5"):
        step = exp_step(session, [4, 1, 2, 8])
    assert step.mode == "online"


def test_more_saves_than_traced_is_detected_at_the_first_extra_one(host):
    session = rt.offload_session(8 * K, min_bytes=0)
    exp_step(session, [4, 1])
    with pytest.warns(OffloadTraceWarning, match="save #2 .* traced step's saved only 2"):
        exp_step(session, [4, 1, 2])


def test_a_changed_step_never_reads_a_wrong_tensor(host):
    # Same shapes, other order of sizes: the plan would move other storages; each
    # handle reads its own record, so the gradients stay exact whatever moves.
    session = rt.offload_session(4 * K, min_bytes=0)
    for sizes in ([4, 4, 1, 8], [8, 1, 4, 4], [1, 8, 4, 4], [8, 1, 4, 4]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadTraceWarning)
            exp_step(session, sizes)  # asserts every gradient


# --------------------------------------------------------------------------- skip_offload


def test_skip_offload_keeps_its_saves_and_is_one_event(host):
    ops = {"n": 1}

    @skip_offload
    def dynamic(h):
        for _ in range(ops["n"]):
            h = h.sin()
        return h

    def step():
        x = torch.randn(4 * KIB_FLOATS, requires_grad=True)
        with session:
            y = dynamic(x.exp()).sin()
            y.sum().backward()
        expected = x.detach().clone().requires_grad_(True)
        dynamic(expected.exp()).sin().sum().backward()
        assert torch.equal(x.grad, expected.grad)
        return session.last_step

    session = rt.offload_session(0, min_bytes=0)
    first = step()
    trace = session.trace
    assert ("region", "dynamic") in trace.marks
    assert len(trace.storages) == 2  # x.exp() and the last sin's input; not those inside
    assert first.offloaded_bytes == 2 * 4 * K
    for n in (3, 0):  # more and fewer ops inside: not a difference
        ops["n"] = n
        with warnings.catch_warnings():
            warnings.simplefilter("error", OffloadTraceWarning)
            assert step().mode == "replay"


def test_skip_offload_outside_a_session_and_its_checks():
    @skip_offload
    def my_custom_function(x):
        return x + 1

    assert my_custom_function.__name__ == "my_custom_function"
    assert my_custom_function.__wrapped__.__name__ == "my_custom_function"
    assert torch.equal(my_custom_function(torch.tensor(5.0)), torch.tensor(6.0))
    with pytest.raises(TypeError, match="skip_offload decorates a function"):
        skip_offload(42)


def test_nested_skip_offload_is_one_region(host):
    @skip_offload
    def inner(x):
        return x.sin()

    @skip_offload
    def outer(x):
        return inner(x).cos()

    session = rt.offload_session(0, min_bytes=0)
    x = torch.randn(8, requires_grad=True)
    with session:
        outer(x).sum().backward()
    assert [m for m in session.trace.marks if m[0] == "region"] == [("region", "outer")]
    assert torch.allclose(x.grad, -torch.sin(torch.sin(x.detach())) * torch.cos(x.detach()))


# --------------------------------------------------------------------------- exceptions


def no_session_left(session):
    assert OffloadSession.get_active() is None
    assert session.pool.in_use_bytes == 0 and session.pool.reserved_bytes == 0
    assert session.offloader.pending_copies == 0
    # No hook of the session is left: what is saved now is not seen by it.
    before = session.offloader.stats.offloaded_bytes
    x = torch.randn(4 * KIB_FLOATS, requires_grad=True)
    x.exp().sum().backward()
    assert session.offloader.stats.offloaded_bytes == before
    with rt.offload_session(0, min_bytes=0):  # and a session can be entered again
        pass


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_exception_in_warmup_drops_the_step(host, error):
    session = rt.offload_session(2 * K, min_bytes=0)

    def fail():
        assert session.last_step.offloaded_bytes > 0  # host blocks are in use now
        assert session.pool.in_use_bytes > 0
        raise error("boom")

    with pytest.raises(error):
        exp_step(session, [4, 1, 2, 8], before_backward=fail)
    no_session_left(session)
    assert session.mode == "warmup" and session.plan is None
    exp_step(session, [4, 1, 2, 8])  # traced again
    assert session.mode == "replay"


def test_an_exception_in_a_replay_drops_the_step_and_keeps_the_plan(host):
    session = rt.offload_session(2 * K, min_bytes=0)
    exp_step(session, [4, 1, 2, 8])
    plan = session.plan

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        exp_step(session, [4, 1, 2, 8], before_backward=fail)
    no_session_left(session)
    assert session.plan is plan and session.mode == "replay"
    assert exp_step(session, [4, 1, 2, 8]).mode == "replay"


def test_a_graph_of_a_failed_step_cannot_be_read(host):
    session = rt.offload_session(0, min_bytes=0)
    x = torch.randn(4 * KIB_FLOATS, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"), session:
        loss = x.exp().sum()
        raise RuntimeError("boom")
    with pytest.raises(RecompError, match="ended with an exception"):
        loss.backward()


# --------------------------------------------------------------------------- lifecycle


def test_sessions_do_not_nest(host):
    session = rt.offload_session(0, min_bytes=0)
    with session:
        with pytest.raises(RecompError, match="cannot be nested: this session"), session:
            pass
        with pytest.raises(RecompError, match="cannot be nested: another"), OffloadSession():
            pass
        assert OffloadSession.get_active() is session
        x = torch.randn(KIB_FLOATS, requires_grad=True)
        x.exp().sum().backward()
    assert session.last_step.saved_bytes == K
    assert OffloadSession.get_active() is None


def test_hyperparallel_lifecycle():
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1))
    assert session.mode == "warmup" and OffloadSession.get_active() is None
    with session as entered:
        assert entered is session and session.mode == "warmup"
        assert OffloadSession.get_active() is session
    assert session.mode == "replay" and OffloadSession.get_active() is None
    with session:
        t = torch.randn(4, 4, requires_grad=True)
        (t + 1).sum().backward()
    assert session.last_step.mode == "replay"


def test_the_host_memory_is_the_pool_and_bounds_the_moves(host):
    assert OffloadSession(OffloadConfig()).pool.max_host_bytes == 65536 * 2**20
    config = OffloadConfig(max_offload_activation_mb=512)
    assert OffloadSession(config).pool.max_host_bytes == 512 * 2**20
    # A pool of 8 KiB: warmup moves what fits, the rest stays over the budget.
    session = OffloadSession(OffloadConfig(
        max_resident_activation_mb=0, max_offload_activation_mb=8 / 1024, min_offload_bytes=0
    ))
    step = exp_step(session, [4, 4, 4])
    assert step.offloaded_bytes == 8 * K and step.over_budget_bytes >= 4 * K
    assert session.pool.reserved_bytes <= 8 * K
    assert "host pool" in str(session.plan)


# --------------------------------------------------------------------------- configuration


def test_config_defaults_and_equality():
    config = OffloadConfig()
    assert (config.max_resident_activation_mb, config.max_offload_activation_mb) == (1024, 65536)
    assert config.planner is None
    assert repr(config).startswith("OffloadConfig(")
    assert "max_resident_activation_mb=1024" in repr(config)
    assert OffloadConfig() == OffloadConfig()
    assert OffloadConfig(max_resident_activation_mb=1) != OffloadConfig(max_resident_activation_mb=2)
    assert OffloadConfig(max_resident_activation_mb=0).budget_bytes == 0
    assert rt.offload_session(3 << 20).config.budget_bytes == 3 << 20


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_resident_activation_mb": -1}, ValueError, "max_resident_activation_mb=1024"),
        ({"max_resident_activation_mb": True}, ValueError, "a number of MiB >= 0"),
        ({"max_resident_activation_mb": float("nan")}, ValueError, "a number of MiB"),
        ({"max_offload_activation_mb": 0}, ValueError, "max_offload_activation_mb=65536"),
        ({"planner": object()}, TypeError, "build\\(trace\\)"),
        ({"min_offload_bytes": -1}, ValueError, "min_offload_bytes=1 << 20"),
        ({"min_offload_bytes": 1.5}, ValueError, "an int of bytes"),
        ({"host_bandwidth": 0}, ValueError, "bytes/s > 0"),
    ],
)
def test_bad_configs_name_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        OffloadConfig(**kwargs)


def test_bad_session_arguments_name_the_fix():
    with pytest.raises(TypeError, match=r"OffloadSession\(OffloadConfig\("):
        OffloadSession(1024)
    with pytest.raises(ValueError, match="budget=8 << 30"):
        rt.offload_session("8GiB")
    with pytest.raises(ValueError, match="host_limit=8 << 30"):
        rt.offload_session(0, host_limit=-1)
    config = OffloadConfig()
    config.max_resident_activation_mb = -5  # changed after construction
    with pytest.raises(ValueError, match="max_resident_activation_mb"):
        OffloadSession(config)


def test_a_planner_of_ones_own(host):
    class MoveNothing:
        def __init__(self):
            self.traces = []

        def build(self, trace):
            from recomp._offload_plan import OffloadPlan

            self.traces.append(trace)
            return OffloadPlan(trace, trace.budget_bytes)

    planner = MoveNothing()
    session = rt.offload_session(2 * K, min_bytes=0, planner=planner)
    exp_step(session, [4, 1, 2])
    assert len(planner.traces) == 1 and planner.traces[0].budget_bytes == 2 * K
    step = exp_step(session, [4, 1, 2])
    # Nothing planned: the budget check moves what passes it, counted as unplanned.
    assert step.mode == "replay" and step.unplanned_evictions > 0


def test_a_hugging_face_llama_with_its_own_checkpointing_switch(host):
    pytest.importorskip("transformers")
    from hf_models import tiny_llama

    plain = tiny_llama(layers=3, hidden=64, heads=4)
    wrapped = copy.deepcopy(plain)
    rt.hf_activation_checkpointing(wrapped, exclude_fn="*.self_attn")
    ids = torch.randint(0, plain.config.vocab_size, (2, 32))

    def run(m, ctx):
        m.zero_grad(set_to_none=True)
        with ctx:
            m(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    reference = run(plain, contextlib.nullcontext())
    for m in (plain, wrapped):
        session = rt.offload_session(32 * K, min_bytes=0)
        for _ in range(2):
            assert_equal(run(m, session), reference)
        step = session.last_step
        assert step.mode == "replay" and step.offloaded_bytes > 0
        largest = max(s.nbytes for s in session.trace.storages)
        assert step.peak_resident_bytes <= 32 * K + largest
