"""Pipeline swap (``recomp.torch.pipeline_swap``) without several processes.

The gap rule on the action lists of ``torch.distributed.pipelining``'s schedules built
on stand-in stages (no process group): which (stage, micro-batch) groups swap, at which
compute slots their copies start and finish, an overlapped slot counted once. Then real
schedules on one gloo rank (one stage, or two stages on the rank), in the offloader's
host-copy mode: gradients bit for bit those of the schedule without swap, the bytes each
group moves counted by hand from the model, the storages moved freed before the
backward, small gaps moving nothing, removal, errors and an exception mid-step.
The two-rank runs are in tests/distributed/test_pipeline_swap.py.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import recomp.torch as rt  # noqa: E402
from pipelines import stage_setup_sends_int64  # noqa: E402
from recomp._pipeline_swap import MIN_SWAP_GAP, plan_rank_swap  # noqa: E402
from recomp.errors import RecompError  # noqa: E402
from recomp.torch._compat import pipeline_slots  # noqa: E402
from recomp.torch._offload import ENV_HOST_COPY  # noqa: E402
from recomp.torch._offload_step import SCOPED_PLACER  # noqa: E402


def _gaps(slots):
    """Per (stage, micro-batch): slots from its forward to the first slot of its
    backward, counted here (an overlapped slot once)."""
    forward, backward = {}, {}
    for i, slot in enumerate(slots):
        for kind, stage, mb in slot:
            if kind == "F":
                forward[(stage, mb)] = i
            else:
                backward.setdefault((stage, mb), i)
    return {key: backward[key] - f for key, f in forward.items()}


# ----------------------------------------------------------------------- the gap rule


def test_gpipe_swaps_every_micro_batch_with_its_steps_in_the_right_slots():
    slots = pipeline_slots("GPipe", 2, 4)[0]  # F0 F1 F2 F3 B0 B1 B2 B3
    plan = plan_rank_swap(slots, rank=0)
    assert plan.min_gap == MIN_SWAP_GAP == 4
    assert {key: c.gap for key, c in plan.chunks.items()} == {(0, m): 4 for m in range(4)}
    assert all(c.swapped for c in plan.chunks.values())
    first = plan.chunks[(0, 0)]
    # Out after its forward (slot 0), finished after the next slot, back before the slot
    # ahead of its backward (slot 4), let go after the backward.
    assert (first.forward_slot, first.wait_slot, first.load_slot, first.release_slot) == (0, 1, 3, 4)
    assert first.off_device_slots == range(2, 3)
    assert plan.steps_off_device((0, 0)) == range(2, 3)
    assert plan.loads_before[3] == ((0, 0),) and plan.waits_after[1] == ((0, 0),)
    assert "4 of 4 (stage, micro-batch) groups swap" in str(plan)
    # At the end of the forwards all 4 are live; with swap micro-batch 0 is back (its
    # backward is next), 2 is still being copied out, 3 just ran: 1 is away.
    assert plan.resident_peak(swap=False) == (4, 3)
    assert plan.resident_peak(swap=True) == (3, 3)
    assert "at the rank's peak: 4 without swap, 3 with" in str(plan)
    # With 8 micro-batches the same three are on the device; the other five are away.
    plan = plan_rank_swap(pipeline_slots("GPipe", 2, 8)[1], rank=1)
    assert plan.resident_peak(False) == (8, 7) and plan.resident_peak(True) == (3, 7)


def test_1f1b_on_two_ranks_leaves_little_room():
    slots = pipeline_slots("1F1B", 2, 4)
    # Rank 0: F0 F1 B0 F2 B1 F3 B2 B3; rank 1: F0 B0 F1 B1 ...
    assert _gaps(slots[0]) == {(0, 0): 2, (0, 1): 3, (0, 2): 3, (0, 3): 2}
    assert _gaps(slots[1]) == {(1, m): 1 for m in range(4)}
    for rank in (0, 1):
        plan = plan_rank_swap(slots[rank], 4, rank)
        assert plan.swapped == []
        assert plan.resident_peak(True) == plan.resident_peak(False)
    plan = plan_rank_swap(slots[0], 3, 0)
    assert {(c.stage, c.microbatch) for c in plan.swapped} == {(0, 1), (0, 2)}
    assert plan.chunks[(0, 0)].why == "gap 2 < 3: too few slots to hide the copies"
    # A gap of 3 hides the copy out in one slot and the copy back in the next; no slot
    # has the group wholly off the device.
    assert plan.chunks[(0, 1)].off_device_slots == range(0)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_every_rank_of_the_looped_and_v_schedules(schedule):
    for rank, slots in pipeline_slots(schedule, 2, 8).items():
        plan = plan_rank_swap(slots, 4, rank)
        gaps = _gaps(slots)
        assert {key: c.gap for key, c in plan.chunks.items()} == gaps
        assert {key for key, c in plan.chunks.items() if c.swapped} == {
            key for key, gap in gaps.items() if gap >= 4
        }
        assert plan.swapped and len(plan.swapped) < len(plan.chunks)


def test_a_split_backward_comes_back_before_its_input_step_and_goes_after_its_weight_step():
    slots = pipeline_slots("ZBVZeroBubble", 2, 4)[0]
    plan = plan_rank_swap(slots, rank=0)
    flat = {step: i for i, slot in enumerate(slots) for step in slot}
    chunk = plan.chunks[(0, 0)]
    assert chunk.swapped
    assert chunk.backward_slot == flat[("I", 0, 0)] and chunk.last_slot == flat[("W", 0, 0)]
    assert chunk.load_slot == flat[("I", 0, 0)] - 1
    assert chunk.release_slot == flat[("W", 0, 0)] > chunk.backward_slot


def test_an_overlapped_slot_counts_once():
    f, b = "F", "B"
    # F(0,0), then two overlapped slots, then its backward: 3 slots, 5 steps.
    slots = [((f, 0, 0),), ((f, 1, 0), (b, 1, 9)), ((f, 1, 1), (b, 1, 8)), ((b, 0, 0),)]
    slots = [((f, 1, 9),), ((f, 1, 8),), *slots]
    plan = plan_rank_swap(slots, 4)
    assert plan.chunks[(0, 0)].gap == 3 and not plan.chunks[(0, 0)].swapped
    # DualPipeV on 2 ranks has such a micro-batch: 6 steps apart, 3 slots.
    slots = pipeline_slots("DualPipeV", 2, 4)[1]
    flat = [step for slot in slots for step in slot]
    assert flat.index(("B", 2, 2)) - flat.index(("F", 2, 2)) == 6
    chunk = plan_rank_swap(slots, 4, 1).chunks[(2, 2)]
    assert chunk.gap == 3 and not chunk.swapped
    # And the job model's flat steps of a group that swaps skip the overlapped parts.
    plan = plan_rank_swap(pipeline_slots("DualPipeV", 2, 4)[0], 4, 0)
    starts = plan.first_steps()
    for c in plan.swapped:
        slots_off = c.off_device_slots
        steps = plan.steps_off_device((c.stage, c.microbatch))
        if slots_off:
            assert steps.start == starts[slots_off.start]


def test_the_guide_s_table_is_what_the_plans_say():
    import paths

    text = (paths.DOCS / "guides" / "pipelines.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and " of " in cells[1]:
            rows[cells[0]] = cells[1:]
    assert set(rows) == {"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                         "ZBVZeroBubble", "DualPipeV"}
    for name, cells in rows.items():
        found = []
        for rank, slots in pipeline_slots(name, 4, 8).items():
            plan = plan_rank_swap(slots, 4, rank)
            found.append(
                f"{len(plan.swapped)} of {len(plan.chunks)}; "
                f"{plan.resident_peak(False)[0]} \u2192 {plan.resident_peak(True)[0]}"
            )
        assert found == cells, name


@pytest.mark.parametrize("bad", [2, 0, True, 4.0, "4", None])
def test_min_gap_must_leave_two_slots(bad):
    with pytest.raises(ValueError, match=r"min_gap=.*an int >= 3"):
        plan_rank_swap([(("F", 0, 0),), (("B", 0, 0),)], bad)


def test_action_lists_that_cannot_be_a_step_are_refused():
    with pytest.raises(ValueError, match="0F0 runs twice"):
        plan_rank_swap([(("F", 0, 0),), (("F", 0, 0),)])
    with pytest.raises(ValueError, match="0B1 before its forward"):
        plan_rank_swap([(("B", 0, 1),)])


# -------------------------------------------------------------- real schedules, one rank

D, SEQ, PER_MB, MICRO = 16, 4, 2, 4
MB_BYTES = PER_MB * SEQ * D * 4  # one micro-batch's activation, float32


class Block(nn.Module):
    """``x + drop(b(a(x)))`` with ``a`` (D -> 2D, tanh) excluded from the replay."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh())
        self.b = nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.b(self.a(x)))


def _moved_per_micro_batch(blocks: int) -> int:
    """What a stage of ``blocks`` checkpointed blocks and a plain tail holds for backward
    per micro-batch, but its input: each block's input (the checkpoint's saved input,
    also the excluded linear's input; the first block's is the stage's input, which the
    pipeline holds and which stays) and the excluded region's tanh output (2 D wide; its
    cached output is the same storage); the tail's linear input and GELU input."""
    return (blocks - 1) * MB_BYTES + blocks * 2 * MB_BYTES + 2 * MB_BYTES


def _stage_module(blocks):
    for block in blocks:
        rt.checkpoint_exclude_wrapper(block.a)
        rt.checkpoint_wrapper(block)
    return nn.Sequential(*blocks, nn.Linear(D, D), nn.GELU())


SCHEDULES = {  # name: (class name, stages on the rank)
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2),
    "DualPipeV": ("ScheduleDualPipeV", 2),
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def host(monkeypatch, one_rank):
    monkeypatch.setenv(ENV_HOST_COPY, "1")


def _loss(out, target):
    return (out - target).square().mean()


class _Pipe:
    def __init__(self, name: str, loss_fn=_loss) -> None:
        from torch.distributed import pipelining

        class_name, local = SCHEDULES[name]
        if not hasattr(pipelining, class_name):
            pytest.skip(f"this PyTorch has no {class_name}")
        if local > 1 and stage_setup_sends_int64():
            pytest.skip("this PyTorch's stages cannot connect on gloo, even on one rank")
        torch.manual_seed(0)
        self.blocks = [Block() for _ in range(4)]
        per = len(self.blocks) // local
        torch.manual_seed(1)
        self.modules = [_stage_module(self.blocks[i * per : (i + 1) * per]) for i in range(local)]
        self.stages = [
            pipelining.PipelineStage(m, i, local, torch.device("cpu"))
            for i, m in enumerate(self.modules)
        ]
        cls = getattr(pipelining, class_name)
        self.schedule = cls(
            self.stages[0] if local == 1 else self.stages, n_microbatches=MICRO, loss_fn=loss_fn
        )
        self.per_stage = per
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(MICRO * PER_MB, SEQ, D, generator=g)
        self.target = torch.randn(self.x.shape, generator=g)

    def step(self) -> list:
        for m in self.modules:
            for p in m.parameters():
                p.grad = None
        torch.manual_seed(3)
        self.schedule.step(self.x, target=self.target)
        return [p.grad.clone() for m in self.modules for p in m.parameters()]


@functools.cache
def _reference(name):
    """The gradients of a step of ``name`` without swap (the same in every test)."""
    pipe = _Pipe(name)
    pipe.step()  # the first step infers shapes
    return pipe.step()


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_gradients_and_bytes_each_way(host, name):
    reference = _reference(name)
    pipe = _Pipe(name)
    swap = rt.pipeline_swap(pipe.schedule, min_bytes=0)
    opened = []
    swap.offloader.group_opened = opened.append
    pipe.step()
    opened.clear()
    grads = pipe.step()
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))
    stats = swap.last_step
    assert stats.unplanned_steps == 0
    gaps = _gaps(pipeline_slots(name, 1, MICRO)[0])
    assert set(stats.chunks) == set(gaps)
    groups = {g.name: g for g in opened}
    moved = _moved_per_micro_batch(pipe.per_stage)
    for (stage, mb), chunk in stats.chunks.items():
        group = groups.get(f"pipeline stage {stage} micro-batch {mb}")
        if gaps[(stage, mb)] >= MIN_SWAP_GAP:
            assert chunk.swapped
            assert chunk.offloaded_bytes == chunk.restored_bytes == chunk.prefetched_bytes == moved
            assert chunk.on_demand_bytes == 0
            assert (group.offloaded_bytes, group.restored_bytes) == (moved, moved)
            # What stayed: the stage's input (the first stage's: the whole batch, whose
            # micro-batches are views of it).
            stage_input = pipe.x.nbytes if stage == 0 else MB_BYTES
            assert chunk.kept_bytes == stage_input
            assert chunk.saved_bytes == moved + stage_input
        else:
            assert not chunk.swapped and group is None
            assert chunk.offloaded_bytes == chunk.restored_bytes == chunk.saved_bytes == 0
    swapped = [c for c in stats.chunks.values() if c.swapped]
    if name == "1F1B":  # on one rank every backward follows its forward
        assert swapped == [] and opened == []
    else:
        assert swapped
    assert swap.offloader.pending_copies == 0
    swap.remove()


def test_moved_storages_are_freed_before_the_backward(host):
    """At the first backward of a GPipe step, the storages each micro-batch's forward
    saved and swap moved are gone (weak references to the storage objects, which live
    exactly as long as the memory); the stage's input, which the pipeline holds, is not.
    Without swap they all live."""
    alive = {}
    for swapped in (False, True):
        refs: list = []
        seen: list = []

        def loss_fn(out, target, refs=refs, seen=seen):
            loss = _loss(out, target)

            def first_backward(grad):  # runs as the step's first backward starts
                if refs and not seen:
                    gc.collect()
                    seen.append([r() is not None for r in refs])

            loss.register_hook(first_backward)
            return loss

        pipe = _Pipe("GPipe", loss_fn)
        swap = rt.pipeline_swap(pipe.schedule, min_bytes=0) if swapped else None
        pipe.step()
        for block in pipe.blocks:
            block.register_forward_pre_hook(
                lambda m, a, refs=refs: refs.append(weakref.ref(a[0].untyped_storage()))
            )
            block.a.register_forward_hook(
                lambda m, a, out, refs=refs: refs.append(weakref.ref(out.untyped_storage()))
            )
        pipe.step()
        alive[swapped] = seen[0]
        if swap is not None:
            swap.remove()
    # Per micro-batch, each of the 4 blocks' input and its excluded region's output.
    assert len(alive[False]) == len(alive[True]) == MICRO * 8
    assert all(alive[False])
    for mb in range(MICRO):
        mine = alive[True][mb * 8 : (mb + 1) * 8]
        # The first block's input is the stage's input: kept.
        assert mine[0] and not any(mine[1:]), (mb, mine)


@pytest.mark.parametrize("name", ["GPipe", "InterleavedZeroBubble"])
def test_removal_leaves_the_schedule_as_it_was(host, name):
    reference = _reference(name)
    pipe = _Pipe(name)
    before = (set(vars(pipe.schedule)), [set(vars(s)) for s in pipe.stages])
    with rt.pipeline_swap(pipe.schedule, min_bytes=0) as swap:
        with pytest.raises(RecompError, match="already has pipeline swap on"):
            rt.pipeline_swap(pipe.schedule)
        pipe.step()
        assert swap.last_step.offloaded_bytes > 0
        assert "on)" in repr(swap)
    assert not swap.active and "removed" in repr(swap)
    assert (set(vars(pipe.schedule)), [set(vars(s)) for s in pipe.stages]) == before
    opened = []
    swap.offloader.group_opened = opened.append
    last = swap.last_step
    assert all(torch.equal(a, b) for a, b in zip(reference, pipe.step(), strict=True))
    assert opened == [] and swap.last_step is last
    swap.remove()  # again: nothing to do
    again = rt.pipeline_swap(pipe.schedule, min_bytes=0)  # on again after removal
    pipe.step()
    assert again.last_step.offloaded_bytes == last.offloaded_bytes
    again.remove()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_mid_step_leaves_nothing_behind(host, error):
    pipe = _Pipe("GPipe")
    swap = rt.pipeline_swap(pipe.schedule, min_bytes=0)
    pipe.step()
    calls = []

    def fail_third(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise error("boom")

    handle = pipe.modules[0].register_forward_pre_hook(fail_third)
    with pytest.raises((error, RuntimeError)):
        pipe.step()
    handle.remove()
    gc.collect()
    assert swap.offloader.pending_copies == 0
    assert swap.pool.in_use_bytes == 0 and swap.pool.reserved_bytes == 0
    assert SCOPED_PLACER.get() is None
    # No hook left behind: a plain save is the tensor itself.
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    assert isinstance(y.grad_fn._saved_result, torch.Tensor)
    # The next step runs as before.
    reference = _reference("GPipe")
    grads = pipe.step()
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))
    assert swap.last_step.offloaded_bytes == MICRO * _moved_per_micro_batch(4)
    swap.remove()


def test_a_schedule_that_runs_other_steps_than_its_action_list_stays_exact(host):
    """A multi-stage schedule runs the action list it prepared when it was built;
    ``pipeline_order`` changed afterwards (micro-batch 0's backward on stage 0 moved to
    the end, the last backward of stage 1 dropped) misleads the plan. The moved backward
    then copies back on demand, the dropped one is counted, and the gradients stay
    those without swap."""
    from recomp.torch._compat.pipelining import _kind

    reference = _reference("Interleaved1F1B")
    pipe = _Pipe("Interleaved1F1B")
    order = [a for a in pipe.schedule.pipeline_order[0] if a is not None]
    first = next(a for a in order if _kind(a) == "B" and (a.stage_index, a.microbatch_index) == (0, 0))
    last = next(a for a in order if _kind(a) == "B" and (a.stage_index, a.microbatch_index) == (1, 3))
    pipe.schedule.pipeline_order[0] = [a for a in order if a not in (first, last)] + [first]
    swap = rt.pipeline_swap(pipe.schedule, min_bytes=0)
    assert swap.plan.chunks[(0, 0)].swapped  # its backward, last in the list, is far away
    pipe.step()
    grads = pipe.step()
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))
    stats = swap.last_step
    assert stats.unplanned_steps == 1
    chunk = stats.chunks[(0, 0)]
    assert chunk.on_demand_bytes == chunk.restored_bytes == chunk.offloaded_bytes > 0
    assert chunk.prefetched_bytes == 0
    swap.remove()


def test_eval_moves_nothing(host):
    pipe = _Pipe("GPipe")
    if not hasattr(pipe.schedule, "eval"):
        pytest.skip("this PyTorch's schedules have no eval()")
    swap = rt.pipeline_swap(pipe.schedule, min_bytes=0)
    pipe.step()
    opened = []
    swap.offloader.group_opened = opened.append
    pipe.schedule.eval(pipe.x, target=pipe.target)
    assert opened == [] and swap.last_step.offloaded_bytes == 0
    swap.remove()


def test_small_storages_stay_and_nothing_moves_on_cpu_without_the_test_mode(
    host, monkeypatch
):
    pipe = _Pipe("GPipe")
    swap = rt.pipeline_swap(pipe.schedule)  # min_bytes 1 MiB: every storage here is smaller
    pipe.step()
    pipe.step()
    assert swap.last_step.offloaded_bytes == 0
    for chunk in swap.last_step.chunks.values():
        assert chunk.swapped and chunk.kept_bytes == chunk.saved_bytes > 0
    swap.remove()
    monkeypatch.delenv(ENV_HOST_COPY)
    if torch.cuda.is_initialized():
        return  # the offloader would move on the device
    swap = rt.pipeline_swap(pipe.schedule, min_bytes=0)
    grads = pipe.step()
    assert all(torch.equal(a, b) for a, b in zip(_reference("GPipe"), grads, strict=True))
    assert swap.last_step.offloaded_bytes == 0
    swap.remove()


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"not a torch\.distributed\.pipelining schedule"):
        rt.pipeline_swap(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"not a torch\.distributed\.pipelining schedule"):
        rt.pipeline_swap(object())
    with pytest.raises(ValueError, match="min_gap=2"):
        rt.pipeline_swap(object(), min_gap=2)
    with pytest.raises(ValueError, match=r"min_bytes=-1"):
        rt.pipeline_swap(object(), min_bytes=-1)
