"""Pipeline swap in the whole-job memory model (``job_memory(..., pipeline_swap=...)``).

On ``torch.distributed.pipelining``'s schedules built on stand-in stages (no process):
the device peak, the host peak and the bytes moved per rank against counts made here
slot by slot from the runtime's own plan (``plan_rank_swap``: which groups swap and
when they are off the device), so that the job model and ``recomp.torch.pipeline_swap``
follow one rule; the group counts against ``RankSwapPlan.resident_peak``; groups under
the gap, a gap longer than the schedule, ``min_bytes``, and the errors. Then real
schedules on one gloo rank: what the runtime moves per step equals what the job model
predicts from a profile of the same model, under several checkpoint options. The
2-rank run that also measures the device and host peaks is
tests/distributed/test_job_memory_pipeline_swap.py.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from pipelines import stage_setup_sends_int64  # noqa: E402
from recomp._pipeline_swap import plan_rank_swap  # noqa: E402
from recomp.plan.job import (  # noqa: E402
    LayerActivation,
    ModelParams,
    Parallel,
    PipelineSwap,
    job_memory,
)
from recomp.plan.planner import ON_INPUT, ON_OUTPUT  # noqa: E402
from recomp.torch._compat import pipeline_actions, pipeline_slots, schedule_names  # noqa: E402

MiB = 1 << 20
P, M = 4, 8
# Two layers per stage; each keeps 3 MiB of one micro-batch: 2 MiB inside the layer
# and 1 MiB of its input (the stage's input where the layer starts a stage).
LAYER = ((2 * MiB, 0), (MiB, ON_INPUT))
KEPT = 3 * MiB
STAGE_KEPT = 2 * KEPT
MOVED = STAGE_KEPT - MiB  # all but the first layer's input


def _needs(schedule: str) -> None:
    if schedule not in schedule_names():
        pytest.skip(f"this PyTorch has no {schedule}")


def _layers(n: int, storages=LAYER, kept: int = KEPT) -> list[LayerActivation]:
    return [
        LayerActivation(f"layers.{i}", "none", kept, kept, swappable=storages) for i in range(n)
    ]


def _job(schedule: str, swap: PipelineSwap | None, storages=LAYER, kept: int = KEPT):
    stages = P * (1 if schedule in ("GPipe", "1F1B") else 2)
    params = ModelParams.from_counts({"sharded": 1000}, 2 * stages)
    return job_memory(
        params,
        Parallel(pp=P),
        activations=_layers(2 * stages, storages, kept),
        schedule=schedule,
        microbatches=M,
        pipeline_swap=swap,
    )


def _by_hand(schedule: str, rank: int, min_gap: int, kept: int, moved: int) -> tuple[int, int]:
    """The device and host peaks of ``rank``, counted slot by slot from the runtime's
    plan: a group is on the device from its forward's slot to its last backward slot,
    ``moved`` of its ``kept`` bytes away during its off-device slots; its host copy
    lives from the end of its forward's slot to its last backward slot (freed there)."""
    plan = plan_rank_swap(pipeline_slots(schedule, P, M)[rank], min_gap, rank)
    device = host = 0
    for i in range(len(plan.slots)):
        on = off = 0
        for c in plan.chunks.values():
            if c.forward_slot <= i <= c.last_slot:
                on += kept - (moved if i in c.off_device_slots else 0)
            if c.swapped and c.forward_slot <= i < c.last_slot:
                off += moved
        device, host = max(device, on), max(host, off)
    return device, host


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_peaks_equal_a_count_from_the_runtime_s_plan(schedule):
    _needs(schedule)
    without = _job(schedule, None)
    job = _job(schedule, PipelineSwap(min_bytes=0))
    for rank in range(P):
        plan = plan_rank_swap(pipeline_slots(schedule, P, M)[rank], 4, rank)
        device, host = _by_hand(schedule, rank, 4, STAGE_KEPT, MOVED)
        r = job.ranks[rank]
        assert (r.activations, r.host) == (device, host), (schedule, rank)
        assert r.swapped_bytes == len(plan.swapped) * MOVED
        assert r.swap_groups == (len(plan.swapped), len(plan.chunks))
        # Without swap: every group held from its forward to its backward.
        assert without.ranks[rank].activations == _by_hand(schedule, rank, 10**6, STAGE_KEPT, 0)[0]
        assert without.ranks[rank].host == 0
        assert r.activations <= without.ranks[rank].activations
        assert r.params == without.ranks[rank].params and r.total - r.activations == (
            without.ranks[rank].total - without.ranks[rank].activations
        )


@pytest.mark.parametrize("schedule", [*SCHEDULES, "ZBVZeroBubble", "DualPipeV"])
def test_groups_on_the_device_are_the_runtime_s_resident_peak(schedule):
    """One byte per (stage, micro-batch), all of it moved: the peak counts the groups on
    the device, as ``RankSwapPlan.resident_peak`` does (the guide's table)."""
    _needs(schedule)
    stages = P * (1 if schedule in ("GPipe", "1F1B") else 2)
    layers = [LayerActivation(f"l{i}", "none", 1, 1, swappable=((1, 0),)) for i in range(stages)]
    params = ModelParams.from_counts({"sharded": 10}, stages)
    for swap in (None, PipelineSwap(min_bytes=0)):
        job = job_memory(
            params, Parallel(pp=P), activations=layers, schedule=schedule, microbatches=M,
            pipeline_swap=swap,
        )  # fmt: skip
        for rank, slots in pipeline_slots(schedule, P, M).items():
            plan = plan_rank_swap(slots, 4, rank)
            assert job.ranks[rank].activations == plan.resident_peak(swap is not None)[0]


def test_the_guide_s_figures_for_gpipe_and_1f1b():
    """GPipe on 4 ranks, 8 micro-batches, 6 MiB kept per stage and micro-batch (1 MiB of
    it the stage's input): 48 MiB on each rank without swap; with it, after the last
    forward, 3 groups whole (the one coming back for the first backward, the two still
    being copied out) and 5 at their input: 23 MiB, and all 8 copies on the host, 40 MiB.
    1F1B: the first rank 19 MiB (its second group away at its fourth forward) for 24,
    with 4 copies on the host; the second as without swap (its groups come back before
    the peak); the last two move nothing."""
    job = _job("GPipe", PipelineSwap(min_bytes=0))
    assert {(r.activations, r.host) for r in job.ranks} == {(23 * MiB, 40 * MiB)}
    assert {r.peak.action for r in job.ranks} == {f"{s}F7" for s in range(P)}
    assert _job("GPipe", None).ranks[0].activations == 48 * MiB
    job = _job("1F1B", PipelineSwap(min_bytes=0))
    assert [r.activations // MiB for r in job.ranks] == [19, 18, 12, 6]
    assert [r.activations // MiB for r in _job("1F1B", None).ranks] == [24, 18, 12, 6]
    assert [r.swap_groups for r in job.ranks] == [(8, 8), (6, 8), (0, 8), (0, 8)]
    assert [r.host // MiB for r in job.ranks] == [20, 15, 0, 0]


def test_the_guide_s_table_in_bytes_is_what_the_job_model_says():
    import paths

    text = (paths.DOCS / "guides" / "pipelines.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and "\u2192" in cells[1] and ";" in cells[1] and " of " not in cells[1]:
            rows[cells[0]] = cells[1:]
    assert set(rows) == {*SCHEDULES, "ZBVZeroBubble", "DualPipeV"}
    layers = _layers(16, ((16 * MiB, 0), (8 * MiB, ON_INPUT)), 24 * MiB)
    params = ModelParams.from_counts({"sharded": 1000}, 16)
    for name, cells in rows.items():
        _needs(name)
        common = {"activations": layers, "schedule": name, "microbatches": M}
        without = job_memory(params, Parallel(pp=P), **common)
        job = job_memory(params, Parallel(pp=P), pipeline_swap=PipelineSwap(), **common)
        found = [
            f"{a.activations // MiB} \u2192 {b.activations // MiB}; {b.host // MiB}"
            for a, b in zip(without.ranks, job.ranks, strict=True)
        ]
        assert found == cells, name


def test_groups_under_the_gap_and_a_gap_longer_than_the_schedule_change_nothing():
    without = _job("1F1B", None)
    job = _job("1F1B", PipelineSwap(min_bytes=0))
    for rank in (2, 3):  # no 1F1B group there has 4 slots before its backward
        assert job.ranks[rank].activations == without.ranks[rank].activations
        assert job.ranks[rank].host == job.ranks[rank].swapped_bytes == 0
    for schedule in SCHEDULES:
        _needs(schedule)
        far = _job(schedule, PipelineSwap(min_gap=1000, min_bytes=0))
        plain = _job(schedule, None)
        assert [r.activations for r in far.ranks] == [r.activations for r in plain.ranks]
        assert all(r.host == r.swapped_bytes == 0 for r in far.ranks)
        assert all(r.swap_groups[0] == 0 for r in far.ranks)


def test_small_storages_the_stage_s_input_and_output_stay():
    # min_bytes 2 MiB: only the 2 MiB storages move, two per stage and micro-batch.
    job = _job("GPipe", PipelineSwap(min_bytes=2 * MiB))
    assert job.ranks[0].swapped_bytes == M * 4 * MiB
    assert job.ranks[0].activations == _by_hand("GPipe", 0, 4, STAGE_KEPT, 4 * MiB)[0]
    # A storage that is the layer's output stays where the layer ends a stage (the
    # pipeline holds what it sends on), moves where it does not.
    storages = ((2 * MiB, 0), (MiB, ON_OUTPUT))
    job = _job("GPipe", PipelineSwap(min_bytes=0), storages)
    assert job.ranks[0].swapped_bytes == M * 5 * MiB
    # With embeddings before the layers and a head after them, the first stage's input
    # and the last stage's output are made on the stage: they move too.
    params = ModelParams.from_counts({"sharded": 1000}, 2 * P, first={"sharded": 5},
                                     last={"sharded": 5})  # fmt: skip
    for storages, rank in (((2 * MiB, 0), (MiB, ON_INPUT)), 0), (((2 * MiB, 0), (MiB, ON_OUTPUT)), P - 1):
        job = job_memory(
            params, Parallel(pp=P), activations=_layers(2 * P, storages), schedule="GPipe",
            microbatches=M, pipeline_swap=PipelineSwap(min_bytes=0),
        )  # fmt: skip
        assert job.ranks[rank].swapped_bytes == M * STAGE_KEPT
        assert job.ranks[1].swapped_bytes == M * MOVED


def test_the_table_and_the_dict_show_it():
    job = _job("GPipe", PipelineSwap(min_bytes=0))
    text = job.table()
    header = text.splitlines()[0].split()
    assert "host" in header and "swapped" in header
    assert "pipeline swap (min_gap=4, min_bytes=0.00 MiB)" in text
    data = job.to_dict()
    assert data["ranks"][0]["swapped_bytes"] == M * MOVED
    assert data["ranks"][0]["swap_groups"] == [M, M]
    assert data["pipeline_swap"].startswith("pipeline swap (min_gap=4")


def test_errors_name_what_to_change():
    with pytest.raises(ValueError, match=r"min_gap=2.*int >= 3"):
        PipelineSwap(min_gap=2)
    with pytest.raises(ValueError, match=r"min_bytes=-1"):
        PipelineSwap(min_bytes=-1)
    with pytest.raises(ValueError, match="pipeline_swap is a PipelineSwap"):
        _job("GPipe", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give activations="):
        job_memory(ModelParams.from_counts({"sharded": 10}, 4), Parallel(pp=2),
                   pipeline_swap=PipelineSwap())  # fmt: skip
    with pytest.raises(ValueError, match=r"of layer 'layers.0' \(8 layer\(s\)\)"):
        _job("GPipe", PipelineSwap(), storages=None)


# ------------------------------------------------------------- the runtime, one rank

D, SEQ, PER_MB, MICRO = 16, 4, 2, 4


class Block(nn.Module):
    """``x + drop(b(a(x)))``, ``a`` a linear and tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh())
        self.b = nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.b(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def net_and_profile():
    from recomp.plan import profile

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(PER_MB, SEQ, D)
    prof = profile(net, x, loss_fn=lambda out: out.square().mean(), steps=1, clock="cpu")
    return net, prof


@pytest.mark.parametrize(
    ("schedule", "local"), [("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)]
)
@pytest.mark.parametrize("option", ["none", "full", "exclude:a", "selective+exclude:a"])
@pytest.mark.filterwarnings("ignore:A saved_tensors_hooks context:FutureWarning")
def test_what_the_runtime_moves_is_what_the_job_model_predicts(
    one_rank, net_and_profile, monkeypatch, schedule, local, option
):
    """The model's layers under each option, split into the rank's stages, stepped with
    pipeline swap (nothing under ``min_bytes``): the bytes moved in a step equal the job
    model's for the profile of the same model. What stays: the stages' inputs, the
    checkpoints' RNG states, a selective policy's cached outputs (held outside the
    saved-tensor hooks on this PyTorch)."""
    from torch.distributed import pipelining

    import recomp.torch as rt
    from recomp.plan import Plan, apply_plan
    from recomp.plan.planfile import LayerPlan
    from recomp.torch._offload import ENV_HOST_COPY

    _needs(schedule)
    if local > 1 and stage_setup_sends_int64():
        pytest.skip("this PyTorch's stages cannot connect on gloo, even on one rank")
    monkeypatch.setenv(ENV_HOST_COPY, "1")
    net, prof = net_and_profile
    assert option in [o.name for o in prof.layers[0].options]
    net = copy.deepcopy(net)
    apply_plan(net, Plan(0, [LayerPlan(f"layers.{i}", option) for i in range(4)]))
    per = 4 // local
    modules = [nn.Sequential(*net.layers[i * per : (i + 1) * per]) for i in range(local)]
    stages = [pipelining.PipelineStage(m, i, local, torch.device("cpu")) for i, m in enumerate(modules)]
    cls = getattr(pipelining, f"Schedule{schedule}")
    sched = cls(stages[0] if local == 1 else stages, n_microbatches=MICRO,
                loss_fn=lambda out, target: out.square().mean())  # fmt: skip
    swap = rt.pipeline_swap(sched, min_bytes=0)
    x = torch.randn(MICRO * PER_MB, SEQ, D)
    sched.step(x, target=x)
    sched.step(x, target=x)
    stats = swap.last_step
    swap.remove()
    assert stats.unplanned_steps == 0

    actions = pipeline_actions(schedule, 1, MICRO, local)
    job = job_memory(
        ModelParams.from_counts({"sharded": 10}, 4),
        Parallel(pp=1, stages_per_rank=local),
        activations=prof,
        option=option,
        schedule=actions if local == 1 else schedule,
        microbatches=MICRO,
        pipeline_swap=PipelineSwap(min_bytes=0),
    )
    rank = job.ranks[0]
    moved = sum(c.offloaded_bytes for c in stats.chunks.values())
    assert rank.swapped_bytes == moved, (option, {k: c.offloaded_bytes for k, c in stats.chunks.items()})
    assert rank.swap_groups[0] == sum(1 for c in stats.chunks.values() if c.swapped) > 0
    # GPipe, one stage of 4 layers: per micro-batch "full" moves the saved inputs of
    # layers 1 to 3 (layer 0's is the stage's input), 512 bytes each.
    if (schedule, option) == ("GPipe", "full"):
        assert moved == MICRO * 3 * PER_MB * SEQ * D * 4
