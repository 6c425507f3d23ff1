"""Every use of PyTorch's private API in recomp (and of transformers'), behind one fence.

The rule: no recomp module outside this package touches a private attribute, module or
name of torch or of another package; ``tools/check_private_api.py`` checks it (this
package and ``mindspore/_compat.py`` are the only places it lets through). Each entry
here says why it is needed, the versions it was checked on, what happens if PyTorch
changes it (each use is guarded: recomp degrades as stated rather than failing at import
or on the first call), and what public API would retire it.

Checked on torch 2.9.1, 2.13.0 and 2.14.1 (and 2.11 on CUDA). Where recomp needs to tell
versions apart, an entry says which versions take which path and how it detects them
(by feature, not by version number).

The package is split by the kind of consumer; everything is re-exported here, and recomp
uses it as ``_compat.name``. Each module has a test file ``tests/torch/compat/test_<module>.py``
with one test per entry that fails when PyTorch changes underneath.

``engine``
    Storage identity, version counters, autograd engine queries (in a backward, which
    one, whether the running node finishes in this pass), a module's own parameter and
    buffer slots: for the engine's torch
    backend, the offloader, kept replays and collective caches.
``checkpoint``
    PyTorch's non-reentrant checkpoint from the inside: its hooks on the saved-tensors
    hook stack, its frame's save counter and holders, the marks of its hooks, the debug
    switch, closing a checkpoint whose function raised, and PyTorch's checkpoint wrapper
    taking a module: for the torch backend, kept replays, the checkpoint debug log, the
    public entry points and the refusal of a second checkpoint around recomp's.
``dispatch``
    Dispatch modes (running without them, hiding selective checkpointing's, a detach
    that shares the version counter, a completed c10d ``Work``), operator names,
    arguments and FLOPs: for the offloader, collective caches, collective counting, the
    planner and the benchmark.
``pytree``
    PyTorch's pytree registry: for recomp's walker of region outputs.
``saved_tensors``
    Reading the autograd graph without unpacking it, and the checkpoint call behind a
    placeholder: for the saved-tensor report.
``cuda``
    The caching allocator's memory history, allocation labels and OOM observer: for
    region labels and the out-of-memory report.
``compile``
    Dynamo and AOTAutograd: the wrapper that marks excluded regions in a compiled
    checkpoint, and the partitioner asked at a memory budget for compiled plans.
``fake``
    Fake tensors and torch.distributed's fake process group: for the planner's
    simulation.
``pipelining``
    Building ``torch.distributed.pipelining``'s schedules on stand-in stages and
    reading their per-rank action lists: for the whole-job memory estimate.
``hf``
    transformers' and diffusers' private layer and model attributes: for the Hugging Face
    integration and the planner's layer finder.
``kernels``
    ATen's FlashAttention op, grouped matrix multiplies and a transformers config's
    attention setting: for the simulated published models (``recomp.plan.models``).
"""

from __future__ import annotations

from .checkpoint import (
    ReplayStore,
    checkpoint_debug_switch,
    checkpoint_save_counter,
    close_enclosing_checkpoint,
    finish_failed_checkpoint,
    guard_checkpoint_wrapper,
    is_early_stop,
    mark_as_checkpoint_hook,
    replace_top_hooks,
    replay_frame,
    replay_store,
    replay_unpack,
    take_checkpoint_unpack,
    top_checkpoint_hooks,
)
from .compile import (
    PLANNABLE_BACKENDS,
    activation_memory_budget,
    compiled_backend_name,
    compiled_original,
    dynamo_bypassing_wrapper,
    dynamo_frame_callback,
    fake_mode_of,
    in_tracing_context,
    many_recompiles,
    partitioning_backend,
    run_at_trace_time,
    separate_backend,
)
from .cuda import attach_cuda_oom_observer, memory_history_enabled, memory_label
from .dispatch import (
    TorchDispatchMode,
    completed_work_factory,
    cpu_attention_ops,
    hide_selective_checkpoint_modes,
    no_dispatch_modes,
    op_arguments,
    op_flop_counter,
    op_name,
    ops_named,
    register_selective_mode_type,
    version_sharing_detach,
)
from .engine import (
    TreeLayout,
    at_pass_end,
    default_group_exists,
    graph_task_id,
    in_backward,
    layout_tensors,
    layout_versions,
    module_attributes,
    module_children,
    module_parameters,
    module_tensor,
    module_tensors,
    node_finishes_in_this_pass,
    pass_keeps_graph,
    storage_key,
    swap_module_tensor,
    tree_layout,
    version,
    versions,
    view_base,
)
from .fake import (
    SIMULATION_MIN_TORCH,
    device_mesh_grid,
    dtensor_meta_as_on_device,
    fake_process_group,
    fake_tensor_mode,
    fake_tensor_type,
    group_size,
    is_fake,
    is_view_op,
    reset_dtensor_random,
    simulation_unsupported,
    target_attention_kernels,
)
from .hf import (
    diffusers_checkpointing_modules,
    diffusers_model,
    hf_causal_mask_as_on_device,
    hf_checkpoint_function,
    hf_grouped_mm_as_on_device,
    hf_layer_keeps_cache,
    hf_no_split_modules,
    is_diffusers_default_checkpoint,
    is_hf_checkpoint_call,
    is_hf_offload_checkpoint,
    set_hf_checkpoint_function,
)
from .kernels import (
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_with_lse,
    grouped_mm,
    loss_parallel,
    set_hf_attention,
)
from .pipelining import (
    forget_failed_step,
    pipeline_actions,
    pipeline_slots,
    schedule_names,
    schedule_slots,
    schedule_stages,
    stage_held_tensors,
    stage_index,
    stage_submodule,
    stage_trains,
    wrap_method,
    wrap_stage_steps,
)
from .pytree import pytree_generation, pytree_node
from .saved_tensors import (
    checkpoint_frame,
    checkpoint_function,
    checkpoint_input_handles,
    checkpoint_plain_arguments,
    checkpoint_rng_states,
    is_compiled_graph_node,
    packed_value,
    replay_tensors,
    saved_handles,
    saved_values_readable,
    selective_checkpoint_storage,
)

__all__ = [
    "PLANNABLE_BACKENDS",
    "SIMULATION_MIN_TORCH",
    "ReplayStore",
    "TorchDispatchMode",
    "TreeLayout",
    "activation_memory_budget",
    "at_pass_end",
    "attach_cuda_oom_observer",
    "checkpoint_debug_switch",
    "checkpoint_frame",
    "checkpoint_function",
    "checkpoint_input_handles",
    "checkpoint_plain_arguments",
    "checkpoint_rng_states",
    "checkpoint_save_counter",
    "close_enclosing_checkpoint",
    "compiled_backend_name",
    "compiled_original",
    "completed_work_factory",
    "cpu_attention_ops",
    "default_group_exists",
    "device_mesh_grid",
    "diffusers_checkpointing_modules",
    "diffusers_model",
    "dtensor_meta_as_on_device",
    "dynamo_bypassing_wrapper",
    "dynamo_frame_callback",
    "fake_mode_of",
    "fake_process_group",
    "fake_tensor_mode",
    "fake_tensor_type",
    "finish_failed_checkpoint",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_with_lse",
    "forget_failed_step",
    "graph_task_id",
    "group_size",
    "grouped_mm",
    "guard_checkpoint_wrapper",
    "hf_causal_mask_as_on_device",
    "hf_checkpoint_function",
    "hf_grouped_mm_as_on_device",
    "hf_layer_keeps_cache",
    "hf_no_split_modules",
    "hide_selective_checkpoint_modes",
    "in_backward",
    "in_tracing_context",
    "is_compiled_graph_node",
    "is_diffusers_default_checkpoint",
    "is_early_stop",
    "is_fake",
    "is_hf_checkpoint_call",
    "is_hf_offload_checkpoint",
    "is_view_op",
    "layout_tensors",
    "layout_versions",
    "loss_parallel",
    "many_recompiles",
    "mark_as_checkpoint_hook",
    "memory_history_enabled",
    "memory_label",
    "module_attributes",
    "module_children",
    "module_parameters",
    "module_tensor",
    "module_tensors",
    "no_dispatch_modes",
    "node_finishes_in_this_pass",
    "op_arguments",
    "op_flop_counter",
    "op_name",
    "ops_named",
    "packed_value",
    "partitioning_backend",
    "pass_keeps_graph",
    "pipeline_actions",
    "pipeline_slots",
    "pytree_generation",
    "pytree_node",
    "register_selective_mode_type",
    "replace_top_hooks",
    "replay_frame",
    "replay_store",
    "replay_tensors",
    "replay_unpack",
    "reset_dtensor_random",
    "run_at_trace_time",
    "saved_handles",
    "saved_values_readable",
    "schedule_names",
    "schedule_slots",
    "schedule_stages",
    "selective_checkpoint_storage",
    "separate_backend",
    "set_hf_attention",
    "set_hf_checkpoint_function",
    "simulation_unsupported",
    "stage_held_tensors",
    "stage_index",
    "stage_submodule",
    "stage_trains",
    "storage_key",
    "swap_module_tensor",
    "take_checkpoint_unpack",
    "target_attention_kernels",
    "top_checkpoint_hooks",
    "tree_layout",
    "version",
    "version_sharing_detach",
    "versions",
    "view_base",
    "wrap_method",
    "wrap_stage_steps",
]
