"""Models of real size for ``recomp.plan.simulate`` and ``recomp simulate``.

Each model is a Hugging Face transformers config class filled with the dimensions its
authors published (the ``config.json`` of the released checkpoint, cited per entry), built
in code: nothing is downloaded, and under ``simulate``'s fake tensors nothing is allocated.
:class:`SimulatedModel` gives the ``build(mesh)`` and ``inputs(mesh)`` that ``simulate``
takes, with a tensor-parallel plan written with ``torch.distributed.tensor.parallel``
(Megatron-style: column-parallel Q/K/V and MLP input projections, row-parallel output
projections, optionally sequence parallelism on the norms), expert parallelism for the
routed experts of mixture-of-experts models, context parallelism
(:func:`context_parallel_attention`) and loss parallelism.

Fewer layers than the model has can be built (``layers=``): the simulated model keeps one
layer of each kind (a dense layer and a mixture-of-experts one for DeepSeek-V3) and
:meth:`SimulatedModel.scale_profile` repeats each simulated layer's profile for the
layers of its kind in the full model (identical layers save identical bytes).

What is modelled, and how (the limits are written here and in docs/tools/will-it-fit.md):

* routed experts run as one grouped matrix multiply per projection
  (``torch.nn.functional.grouped_mm``, as torchtitan and transformers' ``grouped_mm``
  experts do), so that the bytes do not depend on which experts the router picks;
* expert parallelism of degree ``ep``: each rank holds ``num_experts / ep`` experts and
  receives, as a balanced all-to-all would deliver, ``tokens x top_k`` token-expert
  pairs; the all-to-all itself is not simulated (its received buffer is the grouped
  input the rank keeps);
* under tensor parallelism a mixture-of-experts block runs on this rank's share of the
  sequence (sequence parallelism is required there), the router and shared experts
  replicated;
* the output head is column-parallel and its logits gathered for the loss, or with loss
  parallelism left as the ranks' vocabulary shards (the loss computed under PyTorch's
  ``loss_parallel()``): they count outside the layers;
* context parallelism of degree ``cp``: each rank holds two chunks of each sequence (the
  head-tail split, :func:`context_chunks`) and all-gathers the keys and values in its
  attention, keeping what ring attention keeps; the exchange of ring attention's
  rotations is one all-gather here (the same bytes kept, the same link time sent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..torch import _compat
from ._specs import _FAMILIES, MODELS, ModelSpec, layer_kinds, model_names, num_experts, spec

__all__ = [
    "MODELS",
    "GroupedExperts",
    "ModelSpec",
    "SimulatedModel",
    "candidate_regions",
    "context_chunks",
    "context_parallel_attention",
    "flash_attention",
    "hf_config",
    "layer_kinds",
    "model_names",
    "parallelize",
    "parameter_count",
    "register_flash_attention",
    "spec",
]

def _classes(family: str) -> tuple[Any, Any]:
    """The config and causal-LM classes, from their own modules (importing them through
    ``transformers``' top level first indexes every model it has: seconds)."""
    import importlib

    config_name, model_name = _FAMILIES[family]
    package = f"transformers.models.{family}"
    config_module = importlib.import_module(f"{package}.configuration_{family}")
    model_module = importlib.import_module(f"{package}.modeling_{family}")
    return getattr(config_module, config_name), getattr(model_module, model_name)


def hf_config(model: ModelSpec | str, num_layers: int | None = None) -> Any:
    """The transformers config of the model, with ``num_layers`` layers if given (keeping
    at least one layer of each kind the full model has: for DeepSeek-V3 its dense layers
    become ``min(3, num_layers - 1)``). Attention runs through the FlashAttention kernel
    (:func:`flash_attention`)."""
    s = spec(model) if isinstance(model, str) else model
    values = dict(s.values)
    if num_layers is not None:
        kinds = sorted(set(layer_kinds(s)))
        if num_layers < len(kinds):
            raise ValueError(
                f"{s.name} has layers of kinds {kinds}: simulate at least {len(kinds)} layers"
            )
        values["num_hidden_layers"] = num_layers
        if s.family == "deepseek_v3":
            values["first_k_dense_replace"] = min(values["first_k_dense_replace"], num_layers - 1)
    config_class, _ = _classes(s.family)
    config = config_class(**values)
    _compat.set_hf_attention(config, register_flash_attention())
    return config


def parameter_count(model: ModelSpec | str, num_layers: int | None = None) -> int:
    """Parameters of the transformers model, built on the meta device (no memory)."""
    s = spec(model) if isinstance(model, str) else model
    _, model_class = _classes(s.family)
    with torch.device("meta"):
        built = model_class(hf_config(s, num_layers))
    return sum(p.numel() for p in built.parameters())


#: The name under which :func:`flash_attention` is registered with transformers.
FLASH_ATTENTION = "recomp_fa"  # (a name with "flash" in it sends transformers to flash-attn)


def register_flash_attention() -> str:
    """Register :func:`flash_attention` with transformers' attention functions (once)
    and return its name, for ``config._attn_implementation``."""
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from transformers.modeling_utils import AttentionInterface

    if FLASH_ATTENTION not in AttentionInterface():
        AttentionInterface.register(FLASH_ATTENTION, flash_attention)
        # The mask: none without padding, as for transformers' flash attention.
        AttentionMaskInterface.register(FLASH_ATTENTION, flash_attention_mask)
    return FLASH_ATTENTION


def flash_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention through ATen's FlashAttention op, the kernel a training run on a
    recent GPU takes. PyTorch's ``scaled_dot_product_attention`` chooses its kernel by
    asking the device, which fake tensors without a driver cannot answer (it falls back
    to the math kernel, which keeps the ``s x s`` scores); called directly, the op keeps
    what FlashAttention keeps: the query, key and value, the output and the row-wise
    log-sum-exp. Grouped key-value heads are passed as they are (as flash-attn keeps
    them); a value head narrower than the query's (DeepSeek's MLA) is zero-padded to it,
    as transformers' flash path does. Padding masks are not modelled (causal only).
    Under context parallelism (an attention module given a mesh by
    :class:`SimulatedModel`), :func:`context_parallel_attention`."""
    q_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim < q_dim:
        value = torch.nn.functional.pad(value, (0, q_dim - v_dim))
    cp_mesh = getattr(module, CONTEXT_PARALLEL, None)
    if cp_mesh is not None:
        out = context_parallel_attention(query, key, value, cp_mesh, scaling)
    else:
        out = _compat.flash_attention_forward(
            query, key, value, dropout if module.training else 0.0, scaling
        )
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


#: The attribute of an attention module that holds its context-parallel mesh.
CONTEXT_PARALLEL = "recomp_context_parallel"


def context_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunks of the sequence (of ``2 * size``) that context-parallel rank
    ``rank`` holds: ``rank`` and ``2 * size - 1 - rank``, so that every rank has the
    same causal attention work (the head-tail split of torch's and Megatron's context
    parallelism)."""
    return rank, 2 * size - 1 - rank


def context_parallel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mesh: Any, scale: float | None
) -> torch.Tensor:
    """Causal attention of this rank's share of the sequence (two chunks,
    :func:`context_chunks`, in ``(batch, heads, tokens, head_dim)``) against the keys
    and values of the whole sequence, all-gathered over ``mesh`` (1-D, the
    context-parallel ranks). It keeps what ring attention keeps: this rank's query, key
    and value, the output and the log-sum-exp; the backward gathers the keys and values
    again, runs the kernel's backward per chunk and reduce-scatters their gradients."""
    return _ContextParallelAttention.apply(query, key, value, mesh, scale)  # type: ignore[no-any-return]


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Any, key: Any, value: Any, mesh: Any, scale: Any) -> Any:
        keys, values = _gathered_chunks(key, mesh), _gathered_chunks(value, mesh)
        chunks = context_chunks(mesh.get_local_rank(), mesh.size())
        length = query.shape[2] // 2
        outs, lses, states = [], [], []
        for half, chunk in enumerate(chunks):
            q = query[:, :, half * length : (half + 1) * length]
            k, v = torch.cat(keys[: chunk + 1], 2), torch.cat(values[: chunk + 1], 2)
            out, lse, state = _compat.flash_attention_with_lse(q, k, v, scale)
            outs.append(out)
            lses.append(lse)
            states.append(state)
        # The output in (batch, tokens, heads, head_dim) memory, as the kernel lays out
        # its own: the caller's transpose back to that order then copies nothing.
        out = torch.cat([o.transpose(1, 2) for o in outs], 1).transpose(1, 2)
        lse = torch.cat(lses, 2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mesh, ctx.scale, ctx.states = mesh, scale, states
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        from torch.distributed.tensor import DTensor, Partial, Shard

        query, key, value, out, lse = ctx.saved_tensors
        mesh = ctx.mesh
        keys, values = _gathered_chunks(key, mesh), _gathered_chunks(value, mesh)
        chunks = context_chunks(mesh.get_local_rank(), mesh.size())
        length = query.shape[2] // 2
        grad = grad.contiguous()
        dk = [torch.zeros_like(k) for k in keys]
        dv = [torch.zeros_like(v) for v in values]
        dqs = []
        for half, chunk in enumerate(chunks):
            part = slice(half * length, (half + 1) * length)
            k, v = torch.cat(keys[: chunk + 1], 2), torch.cat(values[: chunk + 1], 2)
            dq, dk_part, dv_part = _compat.flash_attention_backward(
                grad[:, :, part], query[:, :, part], k, v, out[:, :, part].contiguous(),
                lse[:, :, part].contiguous(), ctx.states[half], ctx.scale,
            )  # fmt: skip
            dqs.append(dq)
            for c, (gk, gv) in enumerate(zip(dk_part.split(length, 2), dv_part.split(length, 2))):
                dk[c] += gk
                dv[c] += gv

        def scattered(per_chunk: list[Any]) -> Any:
            # Back in the order the ranks hold them, summed over the ranks: this rank's.
            size = mesh.size()
            order = [c for r in range(size) for c in context_chunks(r, size)]
            whole = torch.cat([per_chunk[c] for c in order], 2)
            partial = DTensor.from_local(whole, mesh, [Partial()], run_check=False)
            return partial.redistribute(mesh, [Shard(2)]).to_local()

        return torch.cat(dqs, 2), scattered(dk), scattered(dv), None, None


def _gathered_chunks(t: torch.Tensor, mesh: Any) -> list[torch.Tensor]:
    """The ``2 * size`` chunks of the whole sequence, in sequence order, from every
    context-parallel rank's two (all-gathered along the sequence, dimension 2)."""
    from torch.distributed.tensor import DTensor, Shard

    size = mesh.size()
    whole = DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False).full_tensor()
    pieces = whole.chunk(2 * size, 2)
    order = [c for r in range(size) for c in context_chunks(r, size)]
    by_chunk: list[Any] = [None] * (2 * size)
    for piece, chunk in zip(pieces, order):
        by_chunk[chunk] = piece
    return by_chunk


class _LossParallel:
    """A model's loss function run under ``torch.distributed.tensor.parallel.loss_parallel``:
    the logits are the tensor-parallel ranks' vocabulary shards, and the log-softmax and
    the loss are computed on them (each rank keeps its shard)."""

    def __init__(self, loss: Callable[..., Any]) -> None:
        self.loss = loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _compat.loss_parallel():
            return self.loss(*args, **kwargs)


class GroupedExperts(nn.Module):
    """Routed experts as grouped matrix multiplies: the weights of transformers' experts
    (``gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``) for this rank's
    ``local`` experts, called as transformers' experts module is. Token-expert pairs are
    sorted by expert and each projection is one ``grouped_mm`` over them, so the work
    and the saved bytes depend on the number of pairs only. Under expert parallelism the
    router's global expert ids are folded onto the local experts (``id % local``): the
    pairs a balanced all-to-all delivers to this rank. It keeps what transformers'
    ``grouped_mm`` experts keep (tested against a stock Mixtral)."""

    def __init__(self, local: int, hidden: int, intermediate: int, act: Callable[..., Any]):
        super().__init__()
        self.local = local
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(local, hidden, intermediate))
        self.act_fn = act
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        ids = (top_k_index.reshape(-1) % self.local).to(torch.int32)
        order = torch.argsort(ids)
        pairs = hidden_states[order // k].to(self.gate_up_proj.dtype)
        # histc, not bincount: its output's shape does not depend on the data
        counts = torch.histc(ids.float(), bins=self.local, min=0, max=self.local - 1)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = _compat.grouped_mm(pairs, self.gate_up_proj.transpose(-2, -1), offsets)
        gate, up = gate_up.chunk(2, -1)
        out = _compat.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offsets)
        # In the router's dtype, as transformers does (Mixtral's: fp32, which the product keeps).
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        # Back to token order by a gather, as transformers' grouped_mm experts do: its
        # backward keeps the index only (an ``index_copy_`` would keep its pairs x hidden
        # source as well).
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse].view(tokens, k, -1).sum(1).to(hidden_states.dtype)


@dataclass
class SimulatedModel:
    """``build(mesh)`` and ``inputs(mesh)`` of one published model for ``simulate``.

    ``name``: a published model (``MODELS``) or a :class:`ModelSpec` of your own.
    ``layers``: layers built (None: all). ``tp``: tensor-parallel degree; ``sp``:
    sequence parallelism on the norms and the residual stream; ``ep``: expert-parallel
    degree of the routed experts (default: ``tp``); ``cp``: context-parallel degree
    (each rank holds ``seq / cp`` tokens of each sequence, two chunks of it, and its
    attention sees the keys and values of the whole sequence:
    :func:`context_parallel_attention`); ``loss_parallel``: the head's logits stay the
    tensor-parallel ranks' vocabulary shards and the loss is computed on them
    (``torch.distributed.tensor.parallel.loss_parallel``; a real run's backward must
    run inside that context too). ``batch`` and ``seq``: the micro-batch (sequences
    and tokens each, before context parallelism divides them). The mesh ``build`` and
    ``inputs`` take is the 1-D mesh of :attr:`world_size` ranks (``cp x tp``)."""

    name: str | ModelSpec
    layers: int | None = None
    batch: int = 1
    seq: int = 4096
    dtype: torch.dtype = torch.bfloat16
    tp: int = 1
    sp: bool = False
    ep: int | None = None
    device: str = "cuda"
    cp: int = 1
    loss_parallel: bool = False
    spec: ModelSpec = field(init=False)

    def __post_init__(self) -> None:
        self.spec = self.name if isinstance(self.name, ModelSpec) else spec(self.name)
        errors = self.check()
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def expert_parallel(self) -> int:
        return self.tp if self.ep is None else self.ep

    def check(self) -> list[str]:
        """What does not go together, each with its fix."""
        v, errors = self.spec.values, []
        if min(self.tp, self.cp, self.batch, self.seq) < 1:
            errors.append("tp, cp, batch and seq are positive integers")
            return errors
        heads, kv = v["num_attention_heads"], v.get("num_key_value_heads", v["num_attention_heads"])
        if heads % self.tp or kv % self.tp:
            divisors = [t for t in (1, 2, 4, 8, 16, 32, 64) if heads % t == 0 and kv % t == 0]
            errors.append(
                f"{self.spec.name} has {heads} attention heads and {kv} key-value heads: "
                f"--tp must divide both (one of {divisors})"
            )
        if self.cp > 1 and self.seq % (2 * self.cp):
            errors.append(
                f"context parallelism gives each of --cp {self.cp} ranks two chunks of --seq "
                f"{self.seq}: choose a multiple of {2 * self.cp}"
            )
        elif self.sp and (self.seq // self.cp) % self.tp:
            errors.append(
                f"sequence parallelism splits each rank's {self.seq // self.cp} tokens over "
                f"--tp {self.tp}: choose a --seq that makes it a multiple of {self.tp}"
            )
        if self.loss_parallel and self.tp == 1:
            errors.append("loss parallelism shards the vocabulary over the tensor-parallel "
                          "ranks: add --tp N")
        if self.spec.moe:
            experts = num_experts(self.spec)
            if experts % self.expert_parallel:
                errors.append(
                    f"{self.spec.name} has {experts} routed experts: --ep must divide it"
                )
            if self.tp > 1 and not self.sp:
                errors.append(
                    f"{self.spec.name} is a mixture of experts: under --tp its expert blocks "
                    "run on this rank's share of the sequence, add --sp"
                )
        elif self.ep not in (None, 1):
            errors.append(f"{self.spec.name} has no experts: drop --ep")
        return errors

    def config(self) -> Any:
        return hf_config(self.spec, self.layers)

    def kinds(self) -> list[str]:
        """Per simulated layer, its kind."""
        return _kinds_of(self.spec, self.config())

    def full_kinds(self) -> list[str]:
        return layer_kinds(self.spec)

    @property
    def world_size(self) -> int:
        """The ranks ``simulate`` fakes for it: the context- and tensor-parallel ones."""
        return self.cp * self.tp

    @property
    def layout(self) -> dict[str, Any]:
        """The layout its profile is of (``Profile.layout``; ``recomp.plan.job`` checks
        it against the job's ``Parallel``)."""
        return {"tp": self.tp, "sp": self.sp, "cp": self.cp, "loss_parallel": self.loss_parallel}

    def simulate(
        self,
        *,
        hardware: Any = None,
        exclude_collectives: bool | str = "per-layer",
        swap: bool = True,
    ) -> Any:
        """The profile of one micro-batch on one rank of the full model:
        ``recomp.plan.simulate`` of this model over its ranks, with each layer's attention
        and MLP (or mixture-of-experts block) as the candidate regions
        (:func:`candidate_regions`), scaled to the full depth (:meth:`scale_profile`);
        ``full+partition-inputs`` offered over the tensor-parallel group where the
        layout allows it (:attr:`partition_group`).
        ``hardware``, ``exclude_collectives`` and ``swap`` as for ``simulate``."""
        from .simulation import simulate

        profile = simulate(
            self.build,
            self.inputs,
            world_size=self.world_size,
            device=self.device,
            exclude=candidate_regions,
            exclude_collectives=exclude_collectives,
            hardware=hardware,
            swap=swap,
            partition_inputs=self.partition_group,
        )
        return self.scale_profile(profile)

    @property
    def partition_group(self) -> int | None:
        """The tensor-parallel ranks a checkpoint's inputs may be split over
        (``full+partition-inputs``): ``tp`` where every tensor-parallel rank holds the
        same layer inputs (no sequence parallelism, which splits them already); else
        None."""
        return self.tp if self.tp > 1 and not self.sp else None

    def meta_model(self) -> nn.Module:
        """The whole model (every layer, unparallelised) on the meta device: shapes only,
        for its parameter counts (``recomp.plan.job.model_params``)."""
        _, model_class = _classes(self.spec.family)
        with torch.device("meta"):
            return model_class(hf_config(self.spec))  # type: ignore[no-any-return]

    # -- simulate's callables -------------------------------------------------------

    def build(self, mesh: Any = None) -> nn.Module:
        """The model on ``self.device`` in ``self.dtype`` (under ``simulate``'s fake mode:
        fake tensors), parallelised over ``mesh`` (None: one rank)."""
        _, model_class = _classes(self.spec.family)
        config = self.config()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(config)
                if self.spec.moe:
                    self._replace_experts(model, config)
        finally:
            torch.set_default_dtype(previous)
        model.train()
        tp_mesh, cp_mesh = self._meshes(mesh)
        if tp_mesh is not None:
            parallelize(model, tp_mesh, self.spec, sp=self.sp, loss_parallel=self.loss_parallel)
        if self.loss_parallel:
            model.loss_function = _LossParallel(model.loss_function)
        if cp_mesh is not None:
            for layer in model.model.layers:  # type: ignore[union-attr]
                setattr(layer.self_attn, CONTEXT_PARALLEL, cp_mesh)
        return model

    def _meshes(self, mesh: Any) -> tuple[Any, Any]:
        """The tensor- and context-parallel meshes (None: no such parallelism) of the
        1-D mesh of :attr:`world_size` ranks, ranks ``cp x tp`` (tensor parallel
        innermost)."""
        if mesh is None or self.world_size == 1:
            return None, None
        if mesh.size() != self.world_size:
            raise ValueError(
                f"the mesh has {mesh.size()} ranks, the layout cp={self.cp} x tp={self.tp}: "
                f"give a mesh of {self.world_size}"
            )
        if self.cp == 1:
            return mesh, None
        if self.tp == 1:
            return None, mesh
        grid = _compat.device_mesh_grid(mesh.device_type, (self.cp, self.tp), ("cp", "tp"))
        return grid["tp"], grid["cp"]

    def inputs(self, mesh: Any = None) -> dict[str, Any]:
        """This rank's micro-batch: token ids, labels (the model computes the loss) and
        the positions (sequence parallelism embeds a share of the sequence, the rotary
        embedding needs all of it)."""
        vocab = self.spec.values["vocab_size"]
        with torch.device(self.device):
            ids = torch.randint(0, vocab, (self.batch, self.seq))
            positions = torch.arange(self.seq).unsqueeze(0).expand(self.batch, -1)
            if self.cp == 1:
                return {"input_ids": ids, "labels": ids, "position_ids": positions,
                        "use_cache": False}  # fmt: skip
            # This rank's two chunks of the sequence; each token's label is the next token
            # of the whole sequence (the loss does not shift within the share).
            rank = 0 if mesh is None else mesh.get_local_rank() // self.tp
            length = self.seq // (2 * self.cp)
            share = torch.cat(
                [torch.arange(c * length, (c + 1) * length) for c in context_chunks(rank, self.cp)]
            )
            following = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        return {
            "input_ids": ids[:, share],
            "labels": ids[:, share],
            "shift_labels": following[:, share],
            "position_ids": positions[:, share],
            "use_cache": False,
        }

    def _replace_experts(self, model: nn.Module, config: Any) -> None:
        local = num_experts(self.spec) // self.expert_parallel
        for module in model.modules():
            experts = getattr(module, "experts", None)
            if experts is None or not hasattr(experts, "gate_up_proj"):
                continue
            _, two_i, hidden = experts.gate_up_proj.shape
            module.experts = GroupedExperts(local, hidden, two_i // 2, experts.act_fn)

    # -- scaling ----------------------------------------------------------------------

    def layer_counts(self) -> list[int]:
        """Per simulated layer, how many layers of the full model its profile stands for:
        the last simulated layer of each kind stands for the full model's layers of that
        kind beyond the simulated ones before it."""
        kinds, full = self.kinds(), self.full_kinds()
        counts = [1] * len(kinds)
        for kind in set(kinds):
            last = max(i for i, k in enumerate(kinds) if k == kind)
            counts[last] += full.count(kind) - kinds.count(kind)
        return counts

    def scale_profile(self, profile: Any) -> Any:
        """The profile of the full model: each simulated layer's profile repeated for the
        layers it stands for (:meth:`layer_counts`), renamed ``model.layers.<i>``, with its
        neighbour-shared bytes; the profile's notes say so.

        A storage two simulated layers keep is a neighbours' pair, repeated with every
        layer; one three or more keep (the rotary embedding's tables every layer is
        given) is shared once. With two layers simulated the second kind cannot be told
        from the first: simulate three (the default of ``recomp simulate``)."""
        counts = self.layer_counts()
        if len(profile.layers) != len(counts):
            raise ValueError(
                f"the profile has {len(profile.layers)} layers, the simulated model "
                f"{len(counts)}"
            )
        if all(c == 1 for c in counts):
            return replace(profile, layout=self.layout)
        import copy

        layers: list[Any] = []
        prefix = profile.layers[0].path.rsplit(".", 1)[0]
        for layer, count in zip(profile.layers, counts):
            for _ in range(count):
                clone = copy.deepcopy(layer)
                clone.path = f"{prefix}.{len(layers)}"
                layers.append(clone)
        # The step grows by the added layers' forward and backward, the backward taken
        # as twice the forward (the matrix products' ratio).
        added_s = sum(3 * p.forward_s * (c - 1) for p, c in zip(profile.layers, counts))
        note = (
            f"{len(counts)} layers simulated, scaled to the {sum(counts)} of {self.spec.name}: "
            + ", ".join(f"{p.path} x{c}" for p, c in zip(profile.layers, counts))
            + "; the step without checkpointing grows by 3x the added layers' forward"
        )
        scaled = replace(
            profile,
            layers=layers,
            baseline_step_s=profile.baseline_step_s + added_s,
            notes=[*profile.notes, note],
            layout=self.layout,
        )
        # The copies of a repeated layer overlap the layer after it: only the model's
        # last layer has none (the simulated last layer was priced as that one).
        scaled.retime_host_copies()
        return scaled


def candidate_regions(module: nn.Module) -> bool:
    """The regions an exclusion may keep out of the replay in a published model's layer:
    its attention and its MLP or mixture-of-experts block (not the norms: fewer options,
    the same plans)."""
    return type(module).__name__.endswith(("Attention", "MLP", "MoE", "SparseMoeBlock"))


def _kinds_of(s: ModelSpec, config: Any) -> list[str]:
    values = dict(s.values)
    values["num_hidden_layers"] = config.num_hidden_layers
    if s.family == "deepseek_v3":
        values["first_k_dense_replace"] = config.first_k_dense_replace
    return layer_kinds(replace(s, values=values))


def parallelize(
    model: nn.Module, mesh: Any, s: ModelSpec, *, sp: bool, loss_parallel: bool = False
) -> None:
    """Tensor parallelism over ``mesh`` (1-D), Megatron's layout, with sequence
    parallelism when ``sp``: column-parallel Q/K/V (or MLA's up-projections) and MLP
    input projections, row-parallel output projections, a row-parallel (vocabulary-
    sharded) embedding whose output is reduce-scattered along the sequence with ``sp``,
    and a column-parallel head whose logits are gathered, or with ``loss_parallel`` left
    as the ranks' vocabulary shards (a DTensor). Mixture-of-
    experts blocks get this rank's share of the sequence as a plain tensor (their
    experts are sharded by expert parallelism, see :class:`GroupedExperts`). Parameters
    are not broadcast (``src_data_rank=None``), as a fake process group requires."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    residual = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {
        # Under sequence parallelism the embedding's output is reduce-scattered along the
        # sequence, as Megatron's and torchtitan's are: the first layer gets this rank's
        # share (the positions are given whole, the causal mask is not built).
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top, src_data_rank=None)
    for layer in model.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        plan: dict[str, Any] = {
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": residual},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
            "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
        }
        if getattr(attn, "q_b_proj", None) is not None:  # MLA: shard the up-projections
            plan["self_attn.q_b_proj"] = ColwiseParallel()
            plan["self_attn.kv_b_proj"] = ColwiseParallel()
        else:
            if getattr(attn, "q_proj", None) is not None:
                plan["self_attn.q_proj"] = ColwiseParallel()
            for name in ("k_proj", "v_proj"):
                if getattr(attn, name, None) is not None:
                    plan[f"self_attn.{name}"] = ColwiseParallel()
        if sp:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
        if hasattr(mlp, "experts"):
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(residual,), use_local_output=True
            )
        else:
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            plan["mlp.gate_proj"] = ColwiseParallel()
            plan["mlp.up_proj"] = ColwiseParallel()
            plan["mlp.down_proj"] = RowwiseParallel(output_layouts=residual)
        parallelize_module(layer, mesh, plan, src_data_rank=None)
        _localise_heads(attn, mesh.size())


def _localise_heads(attn: nn.Module, tp: int) -> None:
    """Attention modules that keep a head count for reshapes (MLA's ``num_heads``) see
    this rank's heads."""
    for name in ("num_heads",):
        if hasattr(attn, name):
            setattr(attn, name, getattr(attn, name) // tp)
