"""Megatron-Core on CPU for the tests: the shims it needs without a GPU, a tiny GPTModel,
one training step, and the rank functions tests/trainers/test_megatron.py launches.

Megatron-Core 0.19 asks CUDA for the current device, its random state and its streams.
On a CPU-only machine these shims answer from the CPU: the current device is "cpu", the
"CUDA" generator is the CPU generator (so Megatron's RNG tracker forks the CPU state),
synchronisation does nothing, a stream or event is a stand-in, and the MoE token
dispatcher's split sizes reach ``all_to_all_single`` as lists (gloo takes no tensors
there). They belong to these tests, never to recomp.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

SEED = 1234
VOCAB = 64
SEQ = 16
BATCH = 2
HIDDEN = 32
HEADS = 4
LAYERS = 2


# --------------------------------------------------------------------------- CPU shims


class _StandIn:
    """A CUDA stream or event that does nothing (everything runs in order on the CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _StandIn:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., _StandIn]:
        return _StandIn  # record_event() gives an event, synchronize() waits for nothing


def _split_sizes_as_lists(all_to_all: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(all_to_all)
    def call(group: Any, input_: Any, output_split_sizes_: Any = None,
             input_split_sizes: Any = None, **kwargs: Any) -> Any:
        def as_list(sizes: Any) -> Any:
            return sizes.tolist() if hasattr(sizes, "tolist") else sizes  # tensor, array

        return all_to_all(group, input_, as_list(output_split_sizes_),
                          as_list(input_split_sizes), **kwargs)

    return call


class _Fp8Off:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def _share_storage_by_copy(output: torch.Tensor, recomputed: torch.Tensor) -> None:
    storage = output.untyped_storage()
    source = recomputed.untyped_storage()
    storage.resize_(source.nbytes())
    storage.copy_(source)


_SHIMMED = False


def install_cpu_shims() -> None:
    """Make Megatron-Core run on the CPU (once per process)."""
    global _SHIMMED
    if _SHIMMED:
        return
    _SHIMMED = True
    import megatron.core  # noqa: F401  (imported before its CUDA calls are replaced)

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    # Each shim its own function: Dynamo's rule map refuses one object for two names.
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it: no recursion
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _StandIn
    cuda.Event = _StandIn
    cuda.current_stream = lambda *a, **k: _StandIn()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.random.get_rng_state = cuda.get_rng_state

    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    dispatcher.all_to_all = _split_sizes_as_lists(mappings.all_to_all)
    if not mrandom.HAVE_TE:
        # CheckpointWithoutOutput() (selective "layernorm", "moe_act") takes FP8 to be on
        # whenever its fp8 argument is not None, its default False included, and then
        # asks TransformerEngine: without it, stand-ins that say FP8 is off.
        mrandom.FP8GlobalStateManager = _Fp8Off
        mrandom.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
        mrandom.fp8_autocast = lambda **kwargs: contextlib.nullcontext()
    # It hands the recomputed output to the freed one through a C++ extension compiled
    # at first use (minutes here); a copy into the freed storage gives the same values.
    mrandom._get_share_storage = lambda: _share_storage_by_copy
    # Megatron's tracker warns on every fork that the CPU state changed: on CPU the
    # "CUDA" state is the CPU state.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


# --------------------------------------------------------------------------- model


def initialize(tp: int, ep: int) -> None:
    """Megatron's parallel state on the default (gloo) group."""
    install_cpu_shims()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep
    )


def reseed() -> None:
    """The same random state before every model build and every step: CPU generator and
    Megatron's tracker (its tensor-, data- and expert-parallel states)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)


def config(moe: bool, dropout: float = 0.1, **overrides: Any) -> Any:
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=False,
    )
    if moe:
        fields.update(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
        )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build(moe: bool, dropout: float = 0.1, **overrides: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    reseed()
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False)
    model = GPTModel(
        config=config(moe, dropout, **overrides),
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    model.train()
    return model


def batch(rank_offset: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99 + rank_offset)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not()
    return dict(input_ids=tokens, position_ids=position_ids,
                attention_mask=mask[None, None], labels=labels)


def step(model: Any, data: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Forward and backward of one step from the same random state: the gradients, and
    the bytes recomp's checkpoints keep for collectives' results between the two."""
    from recomp.torch.collectives import kept_collective_bytes

    model.zero_grad(set_to_none=True)
    reseed()
    loss = model(**data).float().mean()
    kept = kept_collective_bytes()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return grads, kept


# --------------------------------------------------------------------------- measuring


def collectives_total(counts: Any) -> dict[str, int]:
    """Collectives of one step by kind, whatever the phase (Megatron's own checkpoint
    replays inside backward, where the counter files its collectives)."""
    total: dict[str, int] = {}
    for kinds in counts.as_dict().values():
        for kind, n in kinds.items():
            total[kind] = total.get(kind, 0) + n
    return total


@contextlib.contextmanager
def calls_of(model: Any, watched: Callable[[str, Any], bool]) -> Iterator[dict[str, int]]:
    """Forward calls of the modules below ``model`` that ``watched(name, module)`` picks."""
    calls: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if watched(name, module):
            calls[name] = 0

            def hook(module: Any, args: Any, output: Any, name: str = name) -> None:
                calls[name] += 1

            handles.append(module.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def trackers_unknown() -> Iterator[None]:
    """recomp does not find Megatron's RNG tracker: the control that shows the tracker
    is what makes dropout replay the same masks."""
    from recomp import _rng_trackers

    saved = _rng_trackers.AUTOMATIC_TRACKERS
    _rng_trackers.AUTOMATIC_TRACKERS = ()
    try:
        yield
    finally:
        _rng_trackers.AUTOMATIC_TRACKERS = saved


def max_difference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    if sorted(grads) != sorted(reference):
        return float("inf")
    return max((grads[k] - reference[k]).abs().max().item() for k in reference)


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)


def selective(*modules: str) -> dict[str, Any]:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


class Variant:
    """One way to train the same model for one step."""

    def __init__(self, recompute: dict[str, Any] | None = None, *,
                 install: dict[str, Any] | None = None,
                 wrap: Callable[[Any], None] | None = None,
                 around: Callable[[], Any] = contextlib.nullcontext, **overrides: Any) -> None:
        self.config = {**(recompute or {}), **overrides}
        self.install = install
        self.wrap = wrap
        self.around = around


def run_variants(
    moe: bool, variants: dict[str, Variant], watched: Callable[[str, Any], bool]
) -> dict:
    """Each variant's gradients against the model without recompute (same weights, same
    data, same random state, dropout 0.1), its collectives per step, the forward calls
    of the ``watched`` modules and the runs and skips of recomp's excluded regions."""
    import recomp.torch.megatron as recomp_megatron
    from recomp.torch.collectives import count_collectives

    started = time.perf_counter()
    data = batch()
    reference_model = build(moe)
    state = reference_model.state_dict()
    with count_collectives() as counts:
        reference, _ = step(reference_model, data)
    results: dict[str, Any] = {
        "none": {"max_diff": 0.0, "collectives": collectives_total(counts),
                 "replay": counts.as_dict()["replay"]},
    }
    for name, variant in variants.items():
        installation = (
            recomp_megatron.install(**variant.install) if variant.install is not None else None
        )
        try:
            model = build(moe, **variant.config)
            model.load_state_dict(state)
            if variant.wrap is not None:
                variant.wrap(model)
            try:
                with variant.around(), calls_of(model, watched) as calls, \
                        count_collectives() as counts:
                    grads, kept = step(model, data)
            except Exception as exc:  # reported to the test, which asserts on it
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            # Read before remove(), which unwraps the modules the exclusions wrapped.
            regions = {
                path: [module.region_runs, module.region_skips]
                for path, module in model.named_modules()
                if hasattr(module, "region_runs")
            }
        finally:
            if installation is not None:
                installation.remove()
        results[name] = {
            "max_diff": max_difference(grads, reference),
            "collectives": collectives_total(counts),
            "replay": counts.as_dict()["replay"],
            "kept_bytes": kept,
            # Layers still holding state of their forward after the step (a replay that
            # stopped early leaves TransformerLayer's pre-MLP norm manager set).
            "state_left": sum(
                getattr(layer, "mlp_norm_manager", None) is not None
                for layer in model.decoder.layers
            ),
            "calls": calls,
            "regions": regions,
        }
    results["seconds"] = time.perf_counter() - started
    return results


def run_dense(rank: int, world_size: int) -> dict:
    """Tensor parallel 2: Megatron's recompute settings with and without recomp."""
    initialize(tp=world_size, ep=1)
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from recomp.torch import apply_activation_checkpointing

    def wrap_layers(model: Any) -> None:
        apply_activation_checkpointing(model, checkpoint_fn=TransformerLayer, early_stop=False)

    def watched(name: str, module: Any) -> bool:
        return isinstance(module, SelfAttention) or name.endswith("input_layernorm")

    variants = {
        "megatron_full": Variant(FULL),
        "megatron_layernorm": Variant(selective("layernorm")),
        "recomp_full": Variant(FULL, install={}),
        "recomp_block": Variant(BLOCK, install={}),
        "recomp_core_attn": Variant(selective("core_attn"), install={}),
        "recomp_mlp": Variant(selective("mlp"), install={}),
        "recomp_layernorm": Variant(selective("layernorm"), install={}),
        "recomp_exclude_class": Variant(FULL, install={"exclude": [SelfAttention]}),
        "recomp_exclude_path": Variant(FULL, install={"exclude": "self_attention"}),
        "recomp_communicates_again": Variant(FULL, install={"exclude_collectives": False}),
        "recomp_tracker_unknown": Variant(FULL, install={}, around=trackers_unknown),
        "recomp_distributed_inputs": Variant(
            FULL, install={}, distribute_saved_activations=True
        ),
        "apply_activation_checkpointing": Variant(wrap=wrap_layers),
        "apply_activation_checkpointing_tracker_unknown": Variant(
            wrap=wrap_layers, around=trackers_unknown
        ),
    }
    results = run_variants(False, variants, watched)
    results["first_input_split"] = first_input_split()
    return results


def first_input_split() -> dict:
    """Megatron's ``checkpoint(function, True, *args)`` with recomp installed, on a
    function of two inputs: what the first input's data is after the forward and after
    the backward, and the gradients."""
    from megatron.core import tensor_parallel

    import recomp.torch.megatron as recomp_megatron

    with recomp_megatron.install():
        first = torch.ones(4, 4, requires_grad=True)
        second = torch.full((4, 4), 2.0, requires_grad=True)
        out = tensor_parallel.checkpoint(lambda a, b: a * b + a, True, first, second)
        after_forward = list(first.data.shape)
        out.sum().backward()
    return {
        "output_exact": bool(torch.equal(out.detach(), torch.full((4, 4), 3.0))),
        "data_after_forward": after_forward,
        "data_after_backward": list(first.data.shape),
        "first_grad_exact": bool(torch.equal(first.grad, torch.full((4, 4), 3.0))),
        "second_grad_exact": bool(torch.equal(second.grad, torch.ones(4, 4))),
        "second_data": list(second.data.shape),  # only the first input is split
    }


def run_moe(rank: int, world_size: int) -> dict:
    """Expert parallel 2 (alltoall dispatcher): Megatron's recompute settings with and
    without recomp, the router excluded by class and by path."""
    initialize(tp=1, ep=world_size)
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from recomp.torch import apply_activation_checkpointing

    def wrap_layers(model: Any) -> None:
        apply_activation_checkpointing(
            model, checkpoint_fn=TransformerLayer, exclude_fn=TopKRouter, early_stop=False
        )

    variants = {
        "megatron_full": Variant(FULL),
        "megatron_moe": Variant(selective("moe")),
        "recomp_full": Variant(FULL, install={}),
        "recomp_moe": Variant(selective("moe"), install={}),
        "recomp_full_exclude_class": Variant(FULL, install={"exclude": [TopKRouter]}),
        "recomp_moe_exclude_class": Variant(selective("moe"), install={"exclude": TopKRouter}),
        "recomp_full_exclude_path": Variant(FULL, install={"exclude": ["mlp.router"]}),
        "recomp_moe_exclude_path": Variant(selective("moe"), install={"exclude": ["router"]}),
        "apply_activation_checkpointing": Variant(wrap=wrap_layers),
    }
    return run_variants(True, variants, lambda name, module: isinstance(module, TopKRouter))


def run_all(rank: int, world_size: int) -> dict:
    """Both configurations in one pair of processes (Megatron takes seconds to import)."""
    return {"dense": run_dense(rank, world_size), "moe": run_moe(rank, world_size)}


def trainer_path() -> str:
    """PYTHONPATH for the ranks: recomp's sources, the launcher's worker, this folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    parts = [os.path.join(os.path.dirname(tests), "src"), os.path.join(tests, "distributed"),
             here, os.path.join(tests, "support")]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


if __name__ == "__main__":  # pragma: no cover - a quick look: torchrun --nproc_per_node 2
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for part, result in run_all(dist.get_rank(), 2).items():
        if dist.get_rank() == 0:
            for key, value in result.items():
                print(part, key, value)
    dist.destroy_process_group()
