"""The planner's offload options (``offload``, ``exclude-offload:R``) and
``full+partition-inputs``: offered where they apply (a host link; tensor parallelism over
replicated inputs), their bytes counted from the recorded forward and checked against what
recomp's offloader moves (CPU, the host-copy test mode), applied by ``apply_plan`` with
exact gradients, mixed per layer with recompute, exclusion and swap; the plan file, the
strategy names, the whole-job host memory and the time model."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch
from torch import nn

from recomp.plan import (
    Parallel,
    Profile,
    apply_plan,
    job_memory,
    load_plan,
    make_plan,
    profiler,
    save_plan,
    simulate,
)
from recomp.plan import apply as apply_module
from recomp.plan import policy as policies
from recomp.plan.planfile import (
    OFFLOAD,
    OFFLOAD_MIN_BYTES,
    PARTITION_INPUTS,
    SWAP,
    parse_option,
)
from recomp.plan.planner import host_copy_seconds
from recomp.torch import CheckpointPolicy, _compat
from recomp.torch import _swap as swap_module
from recomp.torch._offload import DEFAULT_MIN_BYTES
from swap_watch import watch_swap_scopes

MiB = 1 << 20
WIDTH, TOKENS = 256, 1024  # a float32 activation of TOKENS x WIDTH: 1 MiB
HOST = {
    "name": "toy",
    "peak_flops": {"float32": 1e12},
    "memory_bandwidth": 1e11,
    "link_bandwidth": 1e10,
    "host_bandwidth": 1e9,
}
REGIONS = ("exclude-offload:attn", "exclude-offload:mlp", "exclude-offload:attn+mlp")


class Block(nn.Module):
    """A norm, an attention-like and an MLP-like region (their hidden 2 MiB, their output
    1 MiB), residual adds."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(mesh: object = None) -> Model:
    torch.manual_seed(0)
    return Model()


def inputs(mesh: object = None) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(TOKENS, WIDTH, requires_grad=True)


def regions(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential)


# The simulation needs a recent PyTorch; the bytes moved and the gradients are checked on
# a measured profile (the same record, counted by the same code), on every PyTorch.
needs_simulation = pytest.mark.skipif(
    _compat.simulation_unsupported() is not None, reason=str(_compat.simulation_unsupported())
)


@pytest.fixture(scope="module")
def prof() -> Profile:
    """The model's profile measured on this CPU, with a host link given (a CUDA device
    measures its own): the options' bytes are those of a simulated profile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler, "host_link", lambda device: (HOST["host_bandwidth"], "given"))
        return profiler.profile(build(), inputs(), steps=1, exclude=regions)


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Host-copy mode on; every offload group opened (one per swap or offload scope, one
    per offloading region call), in order; and per swap scope that finished, the
    storages its chosen tensors left on the device."""
    yield from watch_swap_scopes(monkeypatch)


@pytest.fixture(scope="module")
def unwrapped() -> list[torch.Tensor]:
    """The gradients of the model without checkpoints or offload."""
    return grads(build())


def grads(model: nn.Module) -> list[torch.Tensor]:
    x = inputs()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]


def plan_of(prof: Profile, options: list[str]):  # type: ignore[no-untyped-def]
    plan = make_plan(prof, "100%")
    for layer, option in zip(plan.layers, options, strict=True):
        layer.option = option
    return plan


def moved_per_layer(opened: list, paths: list[str]) -> list[tuple[int, int]]:  # type: ignore[type-arg]
    """Per layer, the bytes its groups copied to the host and back (a swap scope's group
    is named by its order, a region's by its path)."""
    out = []
    swap_groups = iter(g for g in opened if g.name.startswith("swap_group"))
    for path in paths:
        mine = [g for g in opened if g.name.startswith(path + ".")]
        if not mine:
            mine = [next(swap_groups)]
        out.append((sum(g.offloaded_bytes for g in mine), sum(g.restored_bytes for g in mine)))
    return out


def test_offered_where_they_move_something(prof: Profile) -> None:
    names = [o.name for o in prof.layers[0].options]
    assert names[:2] == ["none", "full"]
    # Before the swap options (which stay last where no collective is replayed).
    assert names[-6:] == [OFFLOAD, *REGIONS, "full+swap-inputs", SWAP]
    for layer in prof.layers:
        for option in (OFFLOAD, *REGIONS):
            got = layer.option(option)
            assert got.swap_bytes > 0 and got.host_bytes > 0
    # Exact, per layer: the norm's input and output (1 MiB each), attn's hidden before
    # and after its GELU (2 MiB each), the MLP's input (1 MiB) and its tanh's output
    # (2 MiB) move; the norm's statistics (4 KiB each) stay.
    layer = prof.layers[1]
    assert (layer.option(OFFLOAD).swap_bytes, layer.option(OFFLOAD).host_bytes) == (9 * MiB,) * 2
    assert layer.option(SWAP).swap_bytes == 9 * MiB + 2 * 4 * TOKENS
    # attn keeps its two hiddens and its output (the MLP's input is computed from it
    # by the replay, so a replay reaches past attn): 5 MiB each way. The MLP keeps its
    # tanh's output, and its output is copied out, then dropped (no replay reaches past
    # it): 3 MiB out, 2 MiB back.
    moves = {o: (layer.option(o).swap_bytes, layer.option(o).host_bytes) for o in REGIONS}
    assert moves == {
        "exclude-offload:attn": (5 * MiB, 5 * MiB),
        "exclude-offload:mlp": (3 * MiB, 2 * MiB),
        "exclude-offload:attn+mlp": (8 * MiB, 7 * MiB),
    }
    # The device keeps the exclusion's bytes less what waits on the host; the replay
    # is the exclusion's.
    for option in REGIONS:
        exclusion = layer.option(option.replace("exclude-offload:", "exclude:"))
        offloaded = layer.option(option)
        assert offloaded.kept_bytes == exclusion.kept_bytes - offloaded.host_bytes
        assert offloaded.replay_flops == exclusion.replay_flops
    # The threshold is the offloader's and the offload session's.
    assert OFFLOAD_MIN_BYTES == DEFAULT_MIN_BYTES == MiB


@needs_simulation
def test_not_offered_where_nothing_would_move_nor_without_a_host_link() -> None:
    def small(mesh: object = None) -> torch.Tensor:
        return torch.randn(16, WIDTH, requires_grad=True)  # every storage under 1 MiB

    names = {o.name for layer in simulate(build, small, device="cpu", hardware=HOST,
                                          exclude=regions).layers for o in layer.options}  # fmt: skip
    assert SWAP in names and OFFLOAD not in names
    assert not any(n.startswith("exclude-offload:") for n in names)
    no_link = {k: v for k, v in HOST.items() if k != "host_bandwidth"}
    prof = simulate(build, inputs, device="cpu", hardware=no_link, exclude=regions)
    names = {o.name for layer in prof.layers for o in layer.options}
    assert OFFLOAD not in names and PARTITION_INPUTS not in names
    assert prof.host_bandwidth is None


@pytest.mark.parametrize("option", [OFFLOAD, *REGIONS])
def test_bytes_moved_are_what_the_offloader_moves_and_gradients_exact(
    prof: Profile,
    groups: dict,  # type: ignore[type-arg]
    option: str,
    monkeypatch: pytest.MonkeyPatch,
    unwrapped: list[torch.Tensor],
) -> None:
    # The storages the offload option's policy keeps on the device (recomp's own call).
    stayed: dict[Hashable, int] = {}

    def policy(t: torch.Tensor) -> object:
        decision = policies.offload_policy(t)
        if decision is CheckpointPolicy.MUST_SAVE:
            stayed[_compat.storage_key(t)] = t.untyped_storage().nbytes()
        return decision

    monkeypatch.setattr(apply_module, "offload_policy", policy)
    want = unwrapped
    model = build()
    apply_plan(model, plan_of(prof, [option] * 4))
    got = grads(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    paths = [layer.path for layer in prof.layers]
    predicted = [(layer.option(option).swap_bytes, layer.option(option).host_bytes)
                 for layer in prof.layers]  # fmt: skip
    assert moved_per_layer(groups["groups"], paths) == predicted
    if option == OFFLOAD:
        # What stays on the device is the predicted activation memory, less what is
        # kept outside the layers: the norm's statistics.
        assert sum(s for g in groups["stayed"] for s in g.values()) == 0  # none shared the output
        left = sum(stayed.values())
        assert left == prof.uniform_bytes(OFFLOAD) - prof.shared_bytes == 4 * 2 * 4 * TOKENS


def test_a_plan_mixes_recompute_exclusion_swap_and_offload_per_layer(
    prof: Profile, groups: dict, tmp_path, unwrapped  # type: ignore[no-untyped-def,type-arg]
) -> None:
    options = [OFFLOAD, "exclude-offload:attn", SWAP, "full"]
    plan = plan_of(prof, options)
    save_plan(plan, tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert [lp.option for lp in again.layers] == options
    assert [lp.offloaded for lp in again.layers] == [True, False, False, False]
    assert [lp.offloads_regions for lp in again.layers] == [False, True, False, False]
    assert [lp.checkpointed for lp in again.layers] == [False, True, False, True]
    want = unwrapped
    model = build()
    apply_plan(model, again)
    assert model.layers[1].attn.region_runs == 0  # an excluded region, not yet run
    assert not hasattr(model.layers[3].attn, "region_runs")
    got = grads(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert model.layers[1].attn.region_runs == 1  # once: the replay skips it
    paths = [layer.path for layer in prof.layers]
    moved = moved_per_layer(groups["groups"], paths[:3])
    predicted = [(layer.option(o).swap_bytes, layer.option(o).host_bytes)
                 for layer, o in zip(prof.layers, options[:3])]  # fmt: skip
    assert moved == predicted
    assert moved[:2] == [(9 * MiB, 9 * MiB), (5 * MiB, 5 * MiB)]
    assert len(groups["groups"]) == 3  # nothing from the full checkpoint
    # The plan's prediction adds up the options' own figures.
    predicted_plan = prof.predict(options)
    assert predicted_plan["replay_flops"] == sum(
        layer.option(o).replay_flops for layer, o in zip(prof.layers, options)
    )


@needs_simulation
def test_the_planner_takes_offload_where_copies_hide_and_recompute_where_they_do_not() -> None:
    """At a budget that full checkpointing meets, with a fast host link every layer's
    copies hide behind the next layer's compute: the plan offloads instead of
    recomputing. With a slow one the copies would show: it recomputes. Only the last
    layer has no next layer to hide behind."""
    fast = simulate(build, inputs, device="cpu", hardware={**HOST, "host_bandwidth": 1e12},
                    exclude=regions)  # fmt: skip
    slow = simulate(build, inputs, device="cpu", hardware={**HOST, "host_bandwidth": 1e6},
                    exclude=regions)  # fmt: skip
    for prof in (fast, slow):
        budget = f"{prof.uniform_bytes('full')}B"
        plan = make_plan(prof, budget)
        options = [lp.option for lp in plan.layers]
        if prof is fast:
            assert all(o in (OFFLOAD, SWAP) or o.startswith("exclude-offload:") or o == "full+swap-inputs"
                       for o in options[:-1]), options  # fmt: skip
            assert plan.predicted["replay_flops"] < make_plan(slow, budget).predicted["replay_flops"]
        else:
            assert not any(o in (OFFLOAD, SWAP) or o.startswith("exclude-offload:")
                           for o in options), options  # fmt: skip
    # The time model, stated once: copies beyond the next layer's forward (out) and
    # twice it (back) show.
    layer, after = slow.layers[0], slow.layers[1]
    offload = layer.option(OFFLOAD)
    assert offload.swap_s == pytest.approx(
        host_copy_seconds(offload.swap_bytes, offload.host_bytes, 1e6, after.forward_s)
    )
    assert offload.swap_s == pytest.approx(
        offload.swap_bytes / 1e6 - after.forward_s + offload.host_bytes / 1e6 - 2 * after.forward_s
    )
    assert offload.replay_s == pytest.approx(offload.swap_s)


@needs_simulation
def test_a_scaled_profile_prices_each_copy_against_the_layer_after_it() -> None:
    """A simulated published model repeats its last simulated layer to the full depth:
    each copy of it hides behind the layer after it, the model's last layer behind
    none."""
    pytest.importorskip("transformers")
    from recomp.plan.models import SimulatedModel

    prof = SimulatedModel("llama-3.1-8b", layers=2, seq=4096).simulate(hardware="H100 SXM")
    assert prof.host_bandwidth == 64e9
    for index in (1, 15, 31):
        layer = prof.layers[index]
        after = prof.layers[index + 1].forward_s if index < 31 else 0.0
        for option in layer.options:
            if option.swap_bytes:
                assert option.swap_s == pytest.approx(host_copy_seconds(
                    option.swap_bytes, option.host_bytes, 64e9, after
                ))  # fmt: skip
    # The last layer's copies hide behind nothing.
    assert prof.layers[15].option(OFFLOAD).swap_s < prof.layers[31].option(OFFLOAD).swap_s


def test_plan_options_are_strategy_names_and_plan_file_options(prof: Profile) -> None:
    from recomp.cli.strategies import parse

    for option in prof.layers[0].options:
        parse_option(option.name)
        assert parse(option.name).name == option.name
    assert parse_option("exclude-offload:attn+mlp") == ("exclude", ("attn", "mlp"))
    assert parse_option(PARTITION_INPUTS) == ("full", ())
    assert parse_option(OFFLOAD) == (OFFLOAD, ())


def test_job_memory_counts_the_host_memory_per_rank(prof: Profile) -> None:
    """Host memory: what each layer holds there, times the micro-batches the rank holds
    at once; beside the device's total, not in it."""
    one = job_memory(build(), Parallel(), activations=prof, option=OFFLOAD, microbatches=3)
    assert one.ranks[0].host == 4 * 9 * MiB  # one micro-batch in flight at a time
    device = job_memory(build(), Parallel(), activations=prof, option="none", microbatches=3)
    assert one.ranks[0].total < device.ranks[0].total
    assert "host" in one.table() and "host" not in device.table()
    assert one.to_dict()["ranks"][0]["host"] == 4 * 9 * MiB
    # 1F1B on 4 ranks (a layer each), 8 micro-batches: rank r holds 4 - r at once.
    piped = job_memory(build(), Parallel(pp=4), activations=prof, option="exclude-offload:mlp",
                       microbatches=8)  # fmt: skip
    assert [r.host for r in piped.ranks] == [4 * 2 * MiB, 3 * 2 * MiB, 2 * 2 * MiB, 2 * MiB]


# --------------------------------------------------------------------- partition


@pytest.fixture(scope="module")
def partitioned() -> Profile:
    return simulate(build, inputs, device="cpu", hardware=HOST, exclude=regions, world_size=2,
                    partition_inputs=2)  # fmt: skip


@needs_simulation
def test_partition_inputs_keeps_this_ranks_slice_and_gathers_it(partitioned: Profile) -> None:
    layer = partitioned.layers[1]
    full, split = layer.option("full"), layer.option(PARTITION_INPUTS)
    # The layer's input (1 MiB, float32) is kept as this rank's half; one all-gather of
    # it in the replay: one rank sends its half (0.5 MiB) over the 10 GB/s link.
    assert split.gather_bytes == MiB // 2
    assert full.kept_bytes - split.kept_bytes == MiB // 2
    assert split.gather_s == pytest.approx((MiB // 2) / 1e10)
    assert split.replay_s == pytest.approx(full.replay_s + split.gather_s)
    assert split.replay_flops == full.replay_flops
    names = [o.name for o in layer.options]
    assert names.index(PARTITION_INPUTS) < names.index(OFFLOAD)
    # The first layer's input is the user's: split all the same, and not released.
    first = partitioned.layers[0]
    assert first.option(PARTITION_INPUTS).kept_bytes == first.option("full").kept_bytes + MiB // 2


@needs_simulation
def test_partition_inputs_offered_only_where_the_layout_has_a_group() -> None:
    prof = simulate(build, inputs, device="cpu", hardware=HOST, exclude=regions, world_size=2)
    assert PARTITION_INPUTS not in [o.name for o in prof.layers[0].options]
    no_times = simulate(build, inputs, device="cpu", exclude=regions, world_size=2,
                        partition_inputs=2)  # fmt: skip
    assert PARTITION_INPUTS not in [o.name for o in no_times.layers[0].options]
    assert any("no full+partition-inputs" in note for note in no_times.notes)
    with pytest.raises(ValueError, match="partition_inputs is the tensor-parallel group's size"):
        simulate(build, inputs, device="cpu", hardware=HOST, world_size=2, partition_inputs=4)


@needs_simulation
def test_partition_inputs_needs_the_group_to_apply(partitioned: Profile) -> None:
    plan = plan_of(partitioned, [PARTITION_INPUTS, "full", OFFLOAD, PARTITION_INPUTS])
    model = build()
    with pytest.raises(ValueError, match=r"apply_plan\(\.\.\., partition_inputs=group\)"):
        apply_plan(model, plan)
    assert not any(type(m).__name__.endswith("Wrapper") for m in model.modules())
    assert swap_module.unwrap_swaps(model) is False  # nothing was wrapped


@needs_simulation
def test_simulated_models_offer_it_without_sequence_parallelism() -> None:
    pytest.importorskip("transformers")
    from recomp.plan.models import SimulatedModel

    assert SimulatedModel("llama-3.1-8b", tp=2).partition_group == 2
    assert SimulatedModel("llama-3.1-8b", tp=2, sp=True).partition_group is None
    assert SimulatedModel("llama-3.1-8b").partition_group is None
    prof = SimulatedModel("llama-3.1-8b", layers=2, seq=1024, tp=2).simulate(hardware="H100 SXM")
    layer = prof.layers[1]
    split = layer.option(PARTITION_INPUTS)
    hidden = 1024 * 4096 * 2  # the layer's input, bf16, the same on both ranks
    assert split.gather_bytes == hidden // 2
    assert layer.option("full").kept_bytes - split.kept_bytes == hidden // 2
