"""Whole-job memory per rank (``recomp.plan.job``): parameters, gradients and optimizer
states against shards PyTorch itself makes (FSDP2 and DTensor tensor parallelism on a
fake process group) and against counts by hand; in-flight micro-batches of each
``torch.distributed.pipelining`` schedule against the known closed forms; the table."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from recomp.plan import job  # noqa: E402
from recomp.plan.job import (  # noqa: E402
    LayerActivation,
    ModelParams,
    Parallel,
    Precision,
    job_memory,
    model_params,
    schedule_actions,
    walk_schedule,
)
from recomp.torch import _compat  # noqa: E402

AVAILABLE = set(_compat.schedule_names())


def _needs(schedule: str) -> None:
    if schedule not in AVAILABLE:
        pytest.skip(f"this PyTorch has no {schedule}")


# ------------------------------------------------------------------ schedules: closed forms


def closed_form(schedule: str, p: int, m: int, rank: int, v: int = 2) -> int:
    """Most (stage, micro-batch) pairs rank ``rank`` of ``p`` holds at once."""
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(p - rank, m)
    if schedule == "LoopedBFS":
        return v * m
    if schedule == "Interleaved1F1B":
        # Narayanan et al. 2021: the first rank warms up with (v - 1) * p + 2 * (p - 1)
        # forwards, then runs one more before its first backward; each later rank two
        # fewer (torch.distributed.pipelining's warm-up, m a multiple of p).
        assert m % p == 0
        return min((v - 1) * p + 2 * (p - 1 - rank) + 1, v * m)
    raise AssertionError(schedule)


SIZES = [(2, 4), (4, 8), (4, 4), (3, 6), (4, 12)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_in_flight_micro_batches_follow_the_closed_forms(schedule, p, m):
    _needs(schedule)
    peaks = walk_schedule(schedule_actions(schedule, p, m))
    assert sorted(peaks) == list(range(p))
    for rank, peak in peaks.items():
        assert peak.microbatches == peak.peak_bytes == closed_form(schedule, p, m, rank), peak
        if schedule == "1F1B":  # stage i of p holds min(p - i, m)
            assert peak.in_flight == {rank: min(p - rank, m)}
            assert peak.action == f"{rank}F{min(p - rank, m) - 1}"


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 6), (4, 12)])
def test_zero_bubble_schedules_peak_like_1f1b(schedule, p, m):
    # Qi et al. 2024: ZB-H1 and ZB-V hold as much as 1F1B's first stage, p micro-batches
    # of a whole stage (2p of half stages), on every rank, counting a micro-batch until
    # its weight-gradient step.
    _needs(schedule)
    peaks = walk_schedule(schedule_actions(schedule, p, m))
    assert {peak.microbatches for peak in peaks.values()} == {2 * p}, peaks


def test_single_stage_schedules_number_micro_batches_in_run_order():
    # PyTorch 2.14.1's Schedule1F1B labels the last rank's forwards 1..m in its
    # pipeline_order; the schedule itself runs micro-batches 0..m-1 in order.
    steps = schedule_actions("1F1B", 4, 8)[3]
    assert steps[:4] == [("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1)]
    for rank_steps in schedule_actions("1F1B", 4, 8).values():
        assert sorted(m for k, _, m in rank_steps if k == "F") == list(range(8))


def test_split_backward_keeps_weight_part_until_w_except_on_stage_zero():
    # Stage 1: F0 F1 I0 W0 I1 W1; kept 10 from F, 3 from I to W. Stage 0 runs its whole
    # backward in W (its inputs need no gradient), so its I frees nothing.
    actions = {
        0: [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("F", 0, 2), ("W", 0, 0)],
        1: [("F", 1, 0), ("F", 1, 1), ("I", 1, 0), ("F", 1, 2), ("W", 1, 0)],
    }
    sizes = {0: (10, 3), 1: (10, 3)}
    peaks = walk_schedule(actions, sizes)
    assert peaks[0].peak_bytes == 30 and peaks[0].action == "0F2"
    assert peaks[1].peak_bytes == 23 and peaks[1].action == "1F2"
    assert peaks[1].held == ((1, 0, "I"), (1, 1, "F"), (1, 2, "F"))
    # With a checkpoint the weight part can exceed what the forward kept: the peak
    # then comes after an input-gradient step.
    peaks = walk_schedule({1: [("F", 1, 0), ("F", 1, 1), ("I", 1, 0), ("W", 1, 0)]}, {1: (2, 5)})
    assert peaks[1].peak_bytes == 7 and peaks[1].action == "1I0"


def test_bad_action_lists_are_refused():
    with pytest.raises(ValueError, match="before its forward"):
        walk_schedule({0: [("B", 0, 0)]})
    with pytest.raises(ValueError, match="runs twice"):
        walk_schedule({0: [("F", 0, 0), ("F", 0, 0)]})
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_actions("Bogus", 2, 4)


# ------------------------------------------------------------------ parameters


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)


class Layer(nn.Module):
    def __init__(self, d: int, experts: int = 0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(3 * d, d, bias=False)
        self.router = nn.Linear(d, experts, bias=False) if experts else None
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))

    def forward(self, x):
        return x + self.out(self.qkv(self.norm(x)))


class Model(nn.Module):
    def __init__(self, d: int = 8, n: int = 4, vocab: int = 30, experts: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, experts) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def test_parameters_by_hand_with_tp_pp_ep_and_zero():
    d, n, vocab, experts = 8, 4, 30, 4
    model = Model(d, n, vocab, experts)
    parallel = Parallel(dp=2, tp=2, pp=2, ep=2, zero=1)
    prec = Precision("bf16", "fp32", "fp32", 2, "fp32")
    result = job_memory(model, parallel, precision=prec)
    # By hand, per pipeline rank: 2-D dense tensors halve (tp), 1-D stay, experts halve
    # (ep); rank 0 holds layers 0-1 and the embedding, rank 1 layers 2-3, norm and head.
    layer_dense = (3 * d * d + 3 * d * d) // 2 + (experts * d) // 2  # qkv, out, router
    layer_norm = 2 * d
    layer_experts = experts * (2 * d * d + 2 * d * d) // 2
    per_layer = layer_dense + layer_norm + layer_experts
    first = vocab * d // 2
    last = 2 * d + vocab * d // 2
    elements = {0: 2 * per_layer + first, 1: 2 * per_layer + last}
    # ZeRO-1 shards the optimizer states: dense over dp=2, experts over
    # tp * dp / ep = 2 ranks.
    for r in result.ranks:
        assert r.param_elements == elements[r.rank]
        assert r.params == 2 * elements[r.rank]
        assert r.grads == 4 * elements[r.rank]
    dense_layer_shard = (
        2 * (3 * d * d // 2 // 2 + 3 * d * d // 2 // 2 + experts * d // 2 // 2) + 2 * (2 * d // 2)
    )
    expert_layer_shard = 2 * experts * (2 * d * d + 2 * d * d) // 2 // 2
    # Per tensor, dim-0 shards: every row count above divides evenly but the
    # embedding's, 15 rows after tp, padded to 2 x 8.
    assert result.ranks[0].optimizer == 12 * (dense_layer_shard + expert_layer_shard + 8 * d)
    flat = job_memory(model, parallel, precision=prec, padding="flat")
    assert flat.ranks[0].optimizer == 12 * (dense_layer_shard + expert_layer_shard + 15 * d // 2)
    # The same from numbers given directly (flat counts, no per-tensor padding).
    counts = ModelParams.from_counts(
        {"sharded": 6 * d * d + experts * d, "replicated": 2 * d, "expert": 4 * experts * d * d},
        n,
        first={"sharded": vocab * d},
        last={"sharded": vocab * d, "replicated": 2 * d},
    )
    again = job_memory(counts, parallel, precision=prec)
    assert [r.params for r in again.ranks] == [r.params for r in result.ranks]
    assert [r.optimizer for r in again.ranks] == [r.optimizer for r in flat.ranks]


def test_zero_stages_shard_what_they_should():
    model = Model()
    base = job_memory(model, Parallel(dp=4), precision="bf16-adam").ranks[0]
    for zero, sharded in [(1, {"optimizer"}), (2, {"optimizer", "grads"}), (3, {"optimizer", "grads", "params"})]:
        got = job_memory(model, Parallel(dp=4, zero=zero), precision="bf16-adam").ranks[0]
        for what in ("params", "grads", "optimizer"):
            if what in sharded:
                assert getattr(got, what) < getattr(base, what) / 3
            else:
                assert getattr(got, what) == getattr(base, what)
        assert (got.gathered > 0) == (zero == 3)


@pytest.fixture
def fake_group():
    """A fake process group of 4 ranks in this process (nothing is communicated)."""
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_match(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Rows that 4 ranks do not divide (30, 3 * 8 = 24 fine, 7): FSDP2 pads dim 0.
    with torch.device("meta"):
        model = Model(d=7, n=2, vocab=30)
    counted = model_params(model)
    mesh = init_device_mesh("cpu", (4,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = sum(p.to_local().numel() for p in model.parameters())  # rank 0's shards
    result = job_memory(counted, Parallel(dp=4, zero=3), precision="fp32-adam")
    assert result.ranks[0].params == 4 * local
    assert result.ranks[0].grads == 4 * local
    assert result.ranks[0].optimizer == 8 * local


def test_tensor_parallel_and_fsdp2_shards_match(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.device("meta"):
        model = Model(d=8, n=2, vocab=30)
    counted = model_params(model, tp_sharded=lambda name, p: 1 if name.endswith("out.weight") else p.dim() >= 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.layers:
        parallelize_module(
            layer, mesh["tp"], {"qkv": ColwiseParallel(), "out": RowwiseParallel()}, src_data_rank=None
        )
    parallelize_module(model, mesh["tp"], {"embed": RowwiseParallel(), "head": ColwiseParallel()}, src_data_rank=None)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    local = sum(p.to_local().numel() for p in model.parameters())
    result = job_memory(counted, Parallel(dp=2, tp=2, zero=3), precision="fp32-adam")
    assert result.ranks[0].params == 4 * local


# ------------------------------------------------------------------ activations, table


def _fake_profile(kept: dict[str, int], n: int, shared: int = 0):
    from recomp.plan.planner import LayerProfile, OptionProfile, Profile

    layers = [
        LayerProfile(
            path=f"layers.{i}",
            type="Layer",
            forward_s=0.0,
            forward_flops=0,
            no_checkpoint_bytes=kept["none"],
            checkpoint_input_bytes=kept["full"],
            regions=[],
            options=[OptionProfile(name, b, 0.0, 0) for name, b in kept.items()],
        )
        for i in range(n)
    ]
    return Profile(device="cpu", baseline_step_s=1.0, shared_bytes=shared, layers=layers)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_activations_follow_the_schedule_and_option(schedule):
    _needs(schedule)
    p, m, n = 2, 4, 8
    prof = _fake_profile({"none": 1000, "full": 100}, n, shared=7)
    model = Model(n=n)
    for option, weight in [("none", None), ("full", None), ("full", 300)]:
        wib = None if weight is None else {f"layers.{i}": weight for i in range(n)}
        result = job_memory(
            model, Parallel(pp=p), activations=prof, option=option, weight_input_bytes=wib,
            schedule=schedule, microbatches=m,
        )
        kept = 1000 if option == "none" else 100
        held_for_w = 1000 if weight is None else min(1000, 100 + weight)
        per_stage_layers = n // len({s for r in result.ranks for s in r.stages})
        stage_kept = {s: kept * per_stage_layers for r in result.ranks for s in r.stages}
        stage_w = {s: held_for_w * per_stage_layers for s in stage_kept}
        last = max(stage_kept)
        for s in (0, last):
            stage_kept[s] += 7
            stage_w[s] += 7
        # A checkpointed layer's replay re-creates what it saves without checkpoint for a
        # while during its own backward: 1000 - 100 over what it keeps.
        replay = 0 if option == "none" else 900
        expected = walk_schedule(
            schedule_actions(schedule, p, m),
            {s: (stage_kept[s], stage_w[s]) for s in stage_kept},
            {s: (replay, replay) for s in stage_kept},
        )
        for r in result.ranks:
            assert r.activations == expected[r.rank].peak_bytes > 0
            assert r.transient in (0, replay)
            if schedule == "1F1B":
                # The peak: the micro-batches stage i holds, during the first backward.
                assert r.saved == min(p - r.rank, m) * stage_kept[r.rank]
                assert r.transient == replay


def test_plan_choice_and_table():
    from recomp.plan import make_plan

    prof = _fake_profile({"none": 1 << 20, "full": 1 << 16}, 4)
    plan = make_plan(prof, "50%")
    per_layer, _ = job.layer_activations(prof, plan=plan)
    assert [a.option for a in per_layer] == [lp.option for lp in plan.layers]
    assert [a.kept_bytes for a in per_layer] == [lp.kept_bytes for lp in plan.layers]
    result = job_memory(
        Model(n=4), Parallel(dp=2, pp=2, zero=1), activations=prof, plan=plan,
        schedule="1F1B", microbatches=4, budget="3MiB",
    )
    text = result.table()
    assert "pp rank" in text and "1F1B, 4 micro-batches" in text
    assert result.fits is (result.peak_bytes <= 3 << 20)
    assert ("does NOT fit" in text) is (not result.fits)
    assert result.to_dict()["ranks"][0]["peak_microbatches"] == 2
    # LayerActivation lists are taken as they are.
    direct = job_memory(
        Model(n=4), Parallel(pp=2), activations=[LayerActivation("x", "none", 5, 5)] * 4,
        schedule="1F1B", microbatches=4,
    )
    assert [r.activations for r in direct.ranks] == [2 * 10, 1 * 10]


def test_weight_input_bytes_counts_inputs_of_modules_with_weights():
    layer = Layer(8)
    x = torch.randn(2, 5, 8)
    # qkv's input (the norm's output), out's input (qkv's output); the norm's input is
    # the layer's own, kept by the checkpoint anyway: 2 * 5 * (8 + 24) floats
    assert job.weight_input_bytes(layer, x) == 4 * 2 * 5 * (8 + 24)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="zero"):
        Parallel(zero=4)
    with pytest.raises(ValueError, match="expert parallel"):
        Parallel(dp=2, ep=4)
    with pytest.raises(ValueError, match="cannot fill"):
        job_memory(Model(n=2), Parallel(pp=4), schedule="1F1B", microbatches=4)


def _live_activation_bytes(skip: set[int]) -> dict[int, int]:
    """Storages of the live Python-visible tensors, parameters and ``skip`` left out."""
    import gc

    seen = {}
    for obj in gc.get_objects():
        # type(): isinstance would read __class__ of every object (deprecated ones warn)
        if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), nn.Parameter):
            try:
                storage = obj.untyped_storage()
                data_ptr = storage.data_ptr()
            except RuntimeError:
                # Tensors left by earlier tests in this process that hold no real memory
                # (fake tensors of a simulation) have no storage to read: not this layer's.
                continue
            if data_ptr not in skip and storage.nbytes() > 8:
                seen[data_ptr] = storage.nbytes()
    return seen


def test_recomp_keeps_the_weight_inputs_between_input_and_weight_passes():
    # What recomp keeps of a checkpointed layer after a split backward's input pass
    # (autograd.grad on the input, retain_graph=True) are the replay's tensors that the
    # weight pass reads: the inputs of the linears and the norm (besides the layer's
    # input, which the checkpoint keeps), and the norm's statistics. It holds them in
    # Python, so the live tensors show them; the weight pass frees them.
    import recomp.torch as rt

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    torch.manual_seed(0)
    block = Block(16)
    x = torch.randn(4, 8, 16, requires_grad=True)
    expected = job.weight_input_bytes(block, x)
    assert expected == 4 * 4 * 8 * (16 + 64)  # fc1's input (the norm's output), fc2's
    rt.checkpoint_wrapper(block)
    y = block(x)
    g = torch.randn_like(y)
    skip = {t.untyped_storage().data_ptr() for t in (x, y, g, *block.parameters())}
    before = _live_activation_bytes(skip)
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    skip.add(dx.untyped_storage().data_ptr())
    kept = {k: v for k, v in _live_activation_bytes(skip).items() if k not in before}
    stats = 2 * 4 * 8 * 4  # the norm's mean and reciprocal deviation per row
    assert sum(kept.values()) == expected + stats, sorted(kept.values())
    torch.autograd.grad(y, list(block.parameters()), g)
    left = {k for k in _live_activation_bytes(skip) if k not in before}
    assert not left


def test_layouts_from_command_lines():
    assert Parallel.parse("dp=8,tp=8 pp=4, zero=1") == Parallel(dp=8, tp=8, pp=4, zero=1)
    with pytest.raises(ValueError, match="name=integer"):
        Parallel.parse("dp=8,tp")
    with pytest.raises(ValueError, match="name=integer"):
        Parallel.parse("xx=2")
    assert "1F1B" in job.schedule_names()


def test_a_measured_profile_and_its_plan_feed_the_estimate():
    from recomp.plan import make_plan, profile

    torch.manual_seed(0)
    model = Model(d=32, n=4, vocab=50)
    ids = torch.randint(0, 50, (2, 16))
    prof = profile(model, (ids,), lambda out: out.float().square().mean(), steps=1)
    plan = make_plan(prof, "50%")
    weights = {
        path: job.weight_input_bytes(model.get_submodule(path), torch.randn(2, 16, 32))
        for path in (layer.path for layer in prof.layers)
    }
    result = job_memory(
        model, Parallel(pp=2), activations=prof, plan=plan, weight_input_bytes=weights,
        schedule="1F1B", microbatches=4,
    )
    kept = [lp.kept_bytes for lp in plan.layers]
    # 1F1B on 2 ranks: rank 0 holds 2 micro-batches of layers 0-1, rank 1 one of 2-3;
    # what is saved before the layers on the first stage, after them (head, loss) on
    # the last, what several layers keep on both.
    assert prof.shared_bytes == (
        prof.before_layers_bytes + prof.after_layers_bytes + prof.spread_bytes
    )
    first = prof.before_layers_bytes + prof.spread_bytes
    last = prof.after_layers_bytes + prof.spread_bytes
    assert result.ranks[0].saved == 2 * (kept[0] + kept[1] + first)
    assert result.ranks[1].saved == kept[2] + kept[3] + last
    assert sum(a.kept_bytes for a in job.layer_activations(prof, plan=plan)[0]) + (
        prof.shared_bytes
    ) == plan.predicted["activation_bytes"]


@pytest.mark.parametrize("v", [3, 4])
def test_interleaved_with_more_stages_per_rank(v):
    p, m = 4, 8
    peaks = walk_schedule(schedule_actions("Interleaved1F1B", p, m, stages_per_rank=v))
    assert [peaks[r].microbatches for r in range(p)] == [
        closed_form("Interleaved1F1B", p, m, r, v) for r in range(p)
    ]
