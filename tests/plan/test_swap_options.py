"""The planner's swap options (``full+swap-inputs``, ``swap``): offered only where the
device has a host link, their bytes counted from the recorded forward and checked
against what recomp's swap really moves and leaves on the device (CPU, with the
offloader's host-copy test mode), applied by ``apply_plan`` with exact gradients."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import recomp.torch as rt
from recomp.plan import Profile, apply_plan, load_plan, make_plan, plan_table, save_plan, simulate
from recomp.plan import profiler as profiler_module
from recomp.plan.cost import ACCELERATORS, Hardware
from recomp.plan.planfile import FULL_SWAP_INPUTS, SWAP
from recomp.torch import _swap as swap_module
from swap_watch import watch_swap_scopes

WIDTH, BATCH = 16, 4
HOST = {
    "name": "toy",
    "peak_flops": {"float32": 1e12},
    "memory_bandwidth": 1e11,
    "link_bandwidth": 1e10,
    "host_bandwidth": 1e9,
}


class Block(nn.Module):
    """fc1, sin, fc2 and a residual add; ``squash``: ends in a tanh, which saves its
    output (an alias of the layer's output, which the swap leaves on the device)."""

    def __init__(self, squash: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.squash = squash

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(torch.sin(self.fc1(x)))
        return torch.tanh(y) if self.squash else y


class Model(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(squash=i % 2 == 1) for i in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(mesh: object = None) -> Model:
    torch.manual_seed(0)
    return Model()


def inputs(mesh: object = None) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH, requires_grad=True)


@pytest.fixture(scope="module")
def prof() -> Profile:
    return simulate(build, inputs, device="cpu", hardware=HOST)


@pytest.fixture
def swaps(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:  # type: ignore[type-arg]
    """Host-copy mode on; per swap scope that finished, its offload group and the
    storages its chosen tensors left on the device (recomp's own bookkeeping)."""
    yield from watch_swap_scopes(monkeypatch)


def grads(model: nn.Module) -> list[torch.Tensor]:
    x = inputs()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]


def with_options(prof: Profile, option: str):  # type: ignore[no-untyped-def]
    plan = make_plan(prof, "100%")
    for layer in plan.layers:
        layer.option = option
    return plan


def test_options_offered_after_the_others_with_a_host_link(prof: Profile) -> None:
    for layer in prof.layers:
        names = [o.name for o in layer.options]
        assert names[:2] == ["none", "full"] and names[-2:] == [FULL_SWAP_INPUTS, SWAP]
        swap = layer.option(SWAP)
        assert swap.replay_flops == 0 and swap.swap_bytes > 0
        assert layer.option(FULL_SWAP_INPUTS).replay_flops == layer.option("full").replay_flops
    # A profile of the current version without the new fields still loads.
    data = prof.to_dict()
    for layer in data["layers"]:
        for option in layer["options"]:
            del option["swap_bytes"], option["swap_s"]
    assert Profile.from_dict(data).layers[0].options[0].swap_bytes == 0


def test_bytes_moved_and_left_are_those_recomp_swaps(prof: Profile, swaps: dict) -> None:  # type: ignore[type-arg]
    bookkeeping = prof.bookkeeping_bytes
    for option in (SWAP, FULL_SWAP_INPUTS):
        swaps["groups"].clear()
        swaps["stayed"].clear()
        model = build()
        apply_plan(model, with_options(prof, option))
        grads(model)
        moved = [(g.offloaded_bytes, g.restored_bytes) for g in swaps["groups"]]
        predicted = [layer.option(option).swap_bytes for layer in prof.layers]
        assert moved == [(n, n) for n in predicted], option
        # What the swap left on the device: the predicted activation memory of the
        # option on every layer, less what is kept outside the layers and the
        # checkpoints' saved RNG states.
        left = [sum(s.values()) for s in swaps["stayed"]]
        checkpoints = len(prof.layers) if option == FULL_SWAP_INPUTS else 0
        predicted_left = (
            prof.uniform_bytes(option) - prof.shared_bytes - bookkeeping * checkpoints
        )
        assert sum(left) == predicted_left, option
        if option == SWAP:
            # The odd layer ends in a tanh: its saved output stays, the rest moves.
            assert left == [0, BATCH * WIDTH * 4, 0]
            squashed = prof.layers[1]
            assert squashed.option(SWAP).swap_bytes == squashed.no_checkpoint_bytes - left[1]


def test_applied_plan_gradients_equal_the_unwrapped_model(prof: Profile, swaps: dict) -> None:  # type: ignore[type-arg]
    want = grads(build())
    plan = make_plan(prof, "100%")
    for layer, option in zip(plan.layers, [SWAP, FULL_SWAP_INPUTS, "full"]):
        layer.option = option
    model = build()
    apply_plan(model, plan)
    assert isinstance(model.layers[1], rt.CheckpointWrapper)
    assert not isinstance(model.layers[0], rt.CheckpointWrapper)
    got = grads(model)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert [g.offloaded_bytes for g in swaps["groups"]] == [
        prof.layers[0].option(SWAP).swap_bytes,
        prof.layers[1].option(FULL_SWAP_INPUTS).swap_bytes,
    ]


def test_plan_round_trip_table_and_choice(prof: Profile, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # At the least memory, only the swap of every layer fits (its odd layer's output
    # stays, nothing else).
    plan = make_plan(prof, f"{prof.uniform_bytes(SWAP)}B")
    assert [layer.option for layer in plan.layers] == [SWAP] * len(prof.layers)
    assert "moves" in plan_table(plan)
    save_plan(plan, tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert [layer.option for layer in again.layers] == [layer.option for layer in plan.layers]
    assert json.loads((tmp_path / "plan.json").read_text())["version"] == 2
    model = build()
    apply_plan(model, again)
    assert all(swap_module.unwrap_swaps(layer) for layer in model.layers)


def test_not_offered_without_a_host_link() -> None:
    table = {k: v for k, v in HOST.items() if k != "host_bandwidth"}
    for prof in (
        simulate(build, inputs, device="cpu", hardware=table),
        simulate(build, inputs, device="cpu"),
        simulate(build, inputs, device="cpu", hardware=HOST, swap=False),
    ):
        names = {o.name for layer in prof.layers for o in layer.options}
        assert SWAP not in names and FULL_SWAP_INPUTS not in names
    assert any("no swap options" in note for note in prof.notes) is False  # swap=False: silent
    assert any("no host_bandwidth" in n for n in simulate(build, inputs, device="cpu",
                                                          hardware=table).notes)  # fmt: skip


def test_profile_on_cpu_notes_why_and_offers_with_a_measured_link(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    prof = profiler_module.profile(build(), inputs(), steps=1)
    assert all(len(layer.options) == 9 for layer in prof.layers)
    assert any("no host link" in note for note in prof.notes)
    # Where the link is measured (CUDA), the options come with it: the same code path.
    monkeypatch.setattr(profiler_module, "host_link", lambda device: (2e9, "measured"))
    prof = profiler_module.profile(build(), inputs(), steps=1)
    swap = prof.layers[0].option(SWAP)
    assert swap.swap_s == pytest.approx(
        max(0.0, swap.swap_bytes / 2e9 - prof.layers[1].forward_s)
        + max(0.0, swap.swap_bytes / 2e9 - 2 * prof.layers[1].forward_s)
    )
    assert "measured" in prof.notes


def test_named_accelerators_carry_their_host_link() -> None:
    for name, spec in ACCELERATORS.items():
        assert spec.host_bandwidth in (32e9, 64e9), name
        assert "host" in spec.describe()
    assert Hardware.from_dict(HOST).host_bandwidth == 1e9
    with pytest.raises(ValueError, match="host_bandwidth"):
        Hardware.from_dict({**HOST, "host_bandwidth": 0})


def test_hugging_face_decoder_layers_keyword_inputs_stay(swaps: dict) -> None:  # type: ignore[type-arg]
    """A Llama decoder layer takes its rotary embeddings, mask and positions as keyword
    arguments: PyTorch's checkpoint holds those itself, so ``swap_inputs`` moves only the
    hidden states; ``swap`` moves everything the layer saves. Bytes as recomp moves them,
    gradients exact."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100,
    )  # fmt: skip

    def hf_build(mesh: object = None) -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    def hf_inputs(mesh: object = None) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "labels": ids}

    def hf_grads(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad()
        model(**hf_inputs()).loss.backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    prof = simulate(hf_build, hf_inputs, device="cpu", hardware=HOST)
    want = hf_grads(hf_build())
    for option in (FULL_SWAP_INPUTS, SWAP):
        swaps["groups"].clear()
        model = hf_build()
        apply_plan(model, with_options(prof, option))
        got = hf_grads(model)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), option
        moved = [(g.offloaded_bytes, g.restored_bytes) for g in swaps["groups"]]
        assert moved == [(layer.option(option).swap_bytes,) * 2 for layer in prof.layers], option
    hidden = 2 * 16 * 64 * 4
    assert [layer.option(FULL_SWAP_INPUTS).swap_bytes for layer in prof.layers] == [hidden] * 2


@pytest.mark.system  # about 14 s here: DTensor's first calls and a measured profile
def test_dtensor_saved_tensors_stay(swaps: dict, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Layers parallelised with DTensor (a process group of one, gloo) save DTensors,
    which the offloader does not copy: the swap's predicted bytes leave them out and
    equal what moves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.layers = nn.ModuleList(
                    nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
                    for _ in range(2)
                )
                for layer in self.layers:
                    parallelize_module(layer, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for layer in self.layers:
                    x = layer(x)
                return x

        monkeypatch.setattr(profiler_module, "host_link", lambda device: (1e9, "given"))
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        prof = profiler_module.profile(Net(), x, steps=1)
        for option in (SWAP, FULL_SWAP_INPUTS):
            swaps["groups"].clear()
            model = Net()
            apply_plan(model, with_options(prof, option))
            model(x).pow(2).mean().backward()
            moved = [g.offloaded_bytes for g in swaps["groups"]]
            assert moved == [layer.option(option).swap_bytes for layer in prof.layers], option
        swap = prof.layers[0].option(SWAP)
        assert 0 < swap.swap_bytes < prof.layers[0].no_checkpoint_bytes
    finally:
        dist.destroy_process_group()
