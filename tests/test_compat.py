"""One test per use of a framework's private API (``recomp/*/_compat.py``).

Each fails when the framework changes what recomp relies on, so an upgrade
shows which workaround to revisit; and no recomp module outside the compat
modules touches private API (``tools/check_private_api.py``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from collections import OrderedDict, defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_private_api_outside_the_compat_modules():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_private_api.py"), str(ROOT / "src" / "recomp")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checker_finds_private_use(tmp_path):
    (tmp_path / "module.py").write_text(
        "import torch\nfrom torch.utils._pytree import tree_flatten\nx = torch._C\n"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_private_api.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "torch.utils._pytree" in result.stdout and "._C" in result.stdout


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_private_api", ROOT / "tools" / "check_private_api.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKER = _checker()


def _flagged(tmp_path, source: str) -> list[str]:
    path = tmp_path / "module.py"
    path.write_text(textwrap.dedent(source))
    return CHECKER.problems(path, "module.py")


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ('def f(t):\n    return getattr(t, "_version", None)\n', "_version"),
        ('def f(cell):\n    return getattr(cell, "_recompute_cell", None)\n', "_recompute_cell"),
        ('def f(m):\n    return hasattr(m, "_hooks")\n', "_hooks"),
        ('def f(m):\n    setattr(m, "_hooks", 1)\n', "_hooks"),
        ('def f(m):\n    delattr(m, "_hooks")\n', "_hooks"),
        ('def f(m):\n    object.__setattr__(m, "_hooks", 1)\n', "_hooks"),
        ('import inspect\ninspect.getattr_static(int, "_hooks")\n', "_hooks"),
    ],
    ids=[
        "getattr",
        "recompute-not-a-recomp-tag",
        "hasattr",
        "setattr",
        "delattr",
        "object-setattr",
        "getattr_static",
    ],
)
def test_the_checker_finds_private_attributes_named_by_a_string(tmp_path, source, name):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and repr(name) in found[0], found


def test_the_checker_passes_attributes_named_by_a_string_that_are_not_private(tmp_path):
    assert not _flagged(
        tmp_path,
        """
        def f(t, kind, name):
            getattr(t, "_recomp_region", None)  # recomp's own tag
            hasattr(kind, "_fields")            # namedtuple API
            getattr(t, "__dict__", None)
            getattr(t, name)                    # not a constant
            object.__setattr__(t, "_recomp_function", f)

        class C:
            def g(self):
                return getattr(self, "_own", None)
        """,
    )


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("from transformers.modeling_layers import _helper\n", "_helper"),
        ("from peft.tuners._private import x\n", "peft.tuners._private"),
        ("import accelerate._internal\n", "accelerate._internal"),
        ("from functools import _lru_cache_wrapper\n", "_lru_cache_wrapper"),
        ("import mindspore.common._grad_function\n", "mindspore.common._grad_function"),
    ],
    ids=["transformers", "peft", "accelerate", "stdlib", "mindspore"],
)
def test_the_checker_finds_private_imports_of_any_other_package(tmp_path, source, what):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and what in found[0], found


def test_the_checker_passes_public_imports_and_recomps_own_modules(tmp_path):
    assert not _flagged(
        tmp_path,
        """
        import peft
        from transformers import PreTrainedModel
        from transformers.modeling_layers import GradientCheckpointingLayer
        from recomp._engine import ExcludedRegion
        from .._engine import ExcludedRegion
        from . import _compat
        """,
    )


@pytest.mark.parametrize(
    "source",
    [
        'import importlib\nimportlib.import_module("mindspore.common._grad_function")\n',
        'import sys\nsys.modules["torch.utils._pytree"]\n',
        'import sys\nsys.modules.get("transformers._private")\n',
    ],
    ids=["import_module", "sys.modules[]", "sys.modules.get"],
)
def test_the_checker_finds_private_modules_named_by_a_string(tmp_path, source):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and "by name" in found[0], found


def test_the_checker_passes_public_modules_named_by_a_string(tmp_path):
    assert not _flagged(
        tmp_path,
        """
        import importlib, sys
        sys.modules.get("transformers.modeling_layers")
        importlib.import_module("recomp._engine")
        sys.modules[name]
        """,
    )


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (
            """
            from torch.utils import flop_counter

            class Counter(flop_counter.FlopCounterMode):
                def _count_flops(self, func_packet, out, args, kwargs):
                    return super()._count_flops(func_packet, out, args, kwargs)
            """,
            "_count_flops",
        ),
        (
            """
            from torch import nn

            class Block(nn.Module):
                _version = 2
            """,
            "_version",
        ),
        (
            """
            import mindspore

            class Block(mindspore.nn.Cell):
                def __init__(self):
                    super().__init__()
                    self._cells = {}
            """,
            "_cells",
        ),
        (
            """
            from ..torch._compat import TorchDispatchMode

            class Recorder(TorchDispatchMode):
                def _next(self):
                    return 1
            """,
            "_next",
        ),
    ],
    ids=["method-override", "class-attribute", "self-attribute", "class-from-compat"],
)
def test_the_checker_finds_private_names_defined_on_a_subclass_of_another_packages_class(
    tmp_path, source, name
):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and f"private name {name} defined on a subclass" in found[0], found


def test_the_checker_passes_public_and_tagged_names_on_subclasses_and_private_names_on_own_classes(
    tmp_path,
):
    assert not _flagged(
        tmp_path,
        """
        import ctypes
        from torch import nn

        class Block(nn.Module):
            _recomp_prefix = "Checkpoint"

            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(2, 2)
                self._recomp_region = None

            def helper(self):
                return self.proj

        class Own:
            def _helper(self):
                self._state = 1

        class Info(ctypes.Structure):
            _fields_ = [("n", ctypes.c_int)]
        """,
    )


# --------------------------------------------------------------------------- torch


class TestTorch:
    torch = pytest.importorskip("torch")

    def test_storage_key_is_shared_by_views_and_differs_between_storages(self):
        from recomp.torch import _compat

        torch = self.torch
        a = torch.randn(4, 6)
        assert _compat.storage_key(a) == _compat.storage_key(a.t()[1:])
        assert _compat.storage_key(a) == _compat.storage_key(a.view(24))
        assert _compat.storage_key(a) != _compat.storage_key(a.clone())
        assert isinstance(_compat.storage_key(a), int)  # the _cdata path, not the fallback

    def test_version_counts_in_place_changes(self):
        from recomp.torch import _compat

        t = self.torch.zeros(3)
        before = _compat.version(t)
        t.add_(1)
        assert _compat.version(t) == before + 1
        with self.torch.inference_mode():
            assert _compat.version(self.torch.zeros(1)) is None

    def test_in_backward_is_true_only_inside_a_backward(self):
        from recomp.torch import _compat

        torch = self.torch
        seen = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                seen.append(_compat.in_backward())
                return g

        x = torch.randn(2, requires_grad=True)
        assert not _compat.in_backward()
        Probe.apply(x).sum().backward()
        assert seen == [True]

    def test_save_counter_follows_the_checkpoint_frame(self):
        from recomp.torch import _compat

        torch = self.torch
        counts = []

        def body(x):
            counter = _compat.checkpoint_save_counter()
            if counter is None:  # the replay: no checkpoint hook on top then
                counts.append(None)
                return torch.sin(x)
            before = counter()
            y = torch.sin(x)  # saves x
            counts.append(counter() - before)
            return y

        x = torch.randn(3, requires_grad=True)
        torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum().backward()
        assert counts == [1, None]
        assert _compat.checkpoint_save_counter() is None  # outside a checkpoint

    def test_selective_checkpoint_modes_are_hidden_and_restored(self):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        from recomp.torch import _compat

        torch = self.torch
        modes = []

        def body(x):
            from torch.utils import _python_dispatch

            stack = _python_dispatch._get_current_dispatch_mode_stack
            before = len(stack())
            with _compat.hide_selective_checkpoint_modes():
                modes.append((before, len(stack())))
            modes.append(len(stack()))
            return torch.sin(x)

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE

        x = torch.randn(3, requires_grad=True)
        torch.utils.checkpoint.checkpoint(
            body,
            x,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(policy),
        )
        (before, inside), after = modes[0], modes[1]
        assert before >= 1 and inside == before - 1 and after == before

    def test_pytree_registry_knows_the_ecosystem_containers(self):
        from recomp.torch import _compat

        torch = self.torch
        for kind in (OrderedDict, defaultdict, type(torch.randn(3).topk(1))):
            node = _compat.pytree_node(kind)
            assert node is not None, kind
        flatten, unflatten = _compat.pytree_node(OrderedDict)
        children, context = flatten(OrderedDict(a=1, b=2))
        assert unflatten(children, context) == OrderedDict(a=1, b=2)
        assert _compat.pytree_node(int) is None

    def test_dispatch_mode_base_and_op_names(self):
        from recomp.torch import _compat

        torch = self.torch
        assert issubclass(_compat.TorchDispatchMode, object)
        seen = []

        class Names(_compat.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(_compat.op_name(func))
                return func(*args, **(kwargs or {}))

        with Names():
            torch.sin(torch.randn(2))
        assert "aten::sin" in seen

    def test_cpu_attention_ops_exist(self):
        from recomp.torch import _compat

        assert _compat.cpu_attention_ops() is not None

    def test_op_flop_counter_hands_each_counted_op_to_on_op(self):
        from recomp.torch import _compat

        torch = self.torch
        seen = []

        class Counter(_compat.op_flop_counter()):
            def on_op(self, func_packet, flops):
                seen.append((func_packet, flops))

        with Counter(display=False) as counter:
            torch.mm(torch.randn(2, 3), torch.randn(3, 4))
            torch.sin(torch.randn(2))  # no formula: not handed on
        assert seen == [(torch.ops.aten.mm, 2 * 2 * 3 * 4)]
        assert counter.get_total_flops() == 2 * 2 * 3 * 4  # FlopCounterMode still counts


# --------------------------------------------------------------------------- MindSpore


# A skip mark, not importorskip in the class body: that would skip the whole file where
# MindSpore is missing (the PyTorch-only environment of the oldest supported PyTorch).
@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")
class TestMindSpore:
    @property
    def ms(self):
        import mindspore

        return mindspore

    def test_executor_queries(self):
        from recomp.mindspore import _compat

        ms = self.ms
        seen = []

        def f(x):
            seen.append(_compat.grad_enabled())
            return (x * x).sum()

        x = ms.Tensor([1.0, 2.0])
        assert not _compat.in_backward()
        ms.grad(f)(x)
        assert seen == [True]
        _compat.sync()

    def test_version_counts_copy_into(self):
        from recomp.mindspore import _compat

        ms = self.ms
        t = ms.ops.zeros((3,), ms.float32)
        before = _compat.version(t)
        t.copy_(ms.ops.ones((3,), ms.float32))
        _compat.sync()
        assert _compat.version(t) == before + 1

    def test_requires_grad_marks_recorded_outputs(self):
        from recomp.mindspore import _compat

        ms = self.ms
        flags = []

        def f(x):
            y = x * 2
            flags.append(_compat.requires_grad(y))
            return y.sum()

        ms.grad(f)(ms.Tensor([1.0, 2.0]))
        assert flags == [True]

    def test_function_base_and_as_strided(self):
        from recomp.mindspore import _compat

        ms = self.ms

        class Double(_compat.function_base()):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g * 2

        grad = ms.grad(lambda x: Double.apply(x).sum())(ms.Tensor([1.0, 2.0]))
        assert grad.asnumpy().tolist() == [2.0, 2.0]
        base = ms.Tensor([[1.0, 2.0], [3.0, 4.0]])
        view = _compat.as_strided()(base, (2,), (2,), 1)
        assert view.asnumpy().tolist() == [2.0, 4.0]

    def test_recompute_called_follows_cell_recompute(self):
        from recomp.mindspore import _compat

        cell = self.ms.nn.Dense(2, 2)
        assert not _compat.recompute_called(cell)
        cell.recompute()
        assert _compat.recompute_called(cell)

    def test_kernel_seeds_are_a_dict_that_dropout_fills(self):
        from recomp.mindspore import _compat

        ms = self.ms
        ms.set_seed(1)
        ms.ops.dropout(ms.ops.ones((8,), ms.float32), p=0.5)
        seeds = _compat.kernel_seeds()
        assert isinstance(seeds, dict) and seeds


class TestTorchCheckpointInternals:
    torch = pytest.importorskip("torch")

    def test_debug_switch_reads_the_global_setter(self):
        from recomp.torch import _compat

        tuc = self.torch.utils.checkpoint
        with tuc.set_checkpoint_debug_enabled(True):
            assert _compat.checkpoint_debug_switch() is True
        assert _compat.checkpoint_debug_switch() is None

    def test_top_checkpoint_hooks_are_found_and_can_be_replaced(self):
        from recomp.torch import _compat

        torch = self.torch
        packed = []

        def body(x):
            hooks = _compat.top_checkpoint_hooks()
            assert hooks is not None

            def pack(t):
                packed.append(t.shape)
                return hooks[0](t)

            with _compat.replace_top_hooks(pack, hooks[1], hooks):
                y = torch.sin(x)
            assert _compat.top_checkpoint_hooks() == hooks
            return y

        x = torch.randn(3, requires_grad=True)
        torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False, early_stop=False)
        assert packed == [torch.Size([3])]
        assert _compat.top_checkpoint_hooks() is None


class TestTorchFailedCheckpoint:
    """PyTorch 2.9 leaves a non-reentrant checkpoint open when its function raises."""

    torch = pytest.importorskip("torch")

    def _hooks_left(self):
        return self.torch._C._autograd._top_saved_tensors_default_hooks(False)

    def test_a_failed_checkpoint_is_closed_from_the_traceback(self):
        from recomp.torch import _compat

        torch = self.torch
        x = torch.randn(3, requires_grad=True)

        def fails(t):
            torch.sin(t)  # saves t into the checkpoint
            raise KeyError("in the checkpointed function")

        with pytest.raises(KeyError) as info:  # info keeps the traceback, as a notebook does
            try:
                torch.utils.checkpoint.checkpoint(fails, x, use_reentrant=False)
            except KeyError as exc:
                _compat.finish_failed_checkpoint(exc)
                raise
        assert info.value.__traceback__ is not None
        assert self._hooks_left() is None
        torch.sin(x).sum().backward()  # saves normally again
        assert torch.equal(x.grad, torch.cos(x))

    def test_an_enclosing_checkpoint_is_closed_before_raising(self):
        from recomp.torch import _compat

        torch = self.torch
        x = torch.randn(3, requires_grad=True)

        def fails(t):
            torch.sin(t)
            error = KeyError("raised inside a plain checkpoint")
            _compat.close_enclosing_checkpoint(error)
            raise error

        with pytest.raises(KeyError) as info:
            torch.utils.checkpoint.checkpoint(fails, x, use_reentrant=False)
        assert info.value.__traceback__ is not None
        assert self._hooks_left() is None
        torch.sin(x).sum().backward()
        assert torch.equal(x.grad, torch.cos(x))


def test_dynamo_bypassing_wrapper_marks_reach_the_partitioner():
    # The op exists (2.9 to 2.14), Dynamo traces it without a graph break, and the
    # MUST_SAVE marks it lets a region put on its nodes are what the partitioner reads:
    # the checkpoint's own tags came first.
    torch = pytest.importorskip("torch")
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from recomp.torch import _compat, checkpoint, checkpoint_exclude_wrapper

    assert callable(_compat.dynamo_bypassing_wrapper())
    marks = []

    def partition(joint, inputs, **kwargs):
        marks.extend(n.meta.get("recompute") for n in joint.graph.nodes if "recomp_region" in n.meta)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=partition,
    )
    region = checkpoint_exclude_wrapper(lambda t: torch.sin(t) * 2, name="probe")

    def step(x):
        return checkpoint(lambda t: torch.cos(region(torch.tanh(t))), x).sum()

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(torch.randn(3, requires_grad=True)).backward()
    torch._dynamo.reset()
    assert marks and set(marks) == {CheckpointPolicy.MUST_SAVE}


def test_run_at_trace_time_runs_when_traced_not_when_run():
    torch = pytest.importorskip("torch")
    from recomp.torch import _compat

    calls = []

    def note() -> bool:
        calls.append(1)
        return True

    noted = _compat.run_at_trace_time(note)

    def step(x):
        noted()
        return torch.sin(x)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # a break would raise
    compiled(torch.randn(3))
    compiled(torch.randn(3))
    torch._dynamo.reset()
    assert calls == [1]


def test_hf_layers_that_only_read_their_cache_say_so():
    pytest.importorskip("torch")
    modeling_layers = pytest.importorskip("transformers.modeling_layers")
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma
    from transformers.models.llama import modeling_llama

    from recomp.torch import _compat

    assert _compat.hf_layer_keeps_cache(modeling_diffusion_gemma.DiffusionGemmaDecoderTextLayer)
    assert not _compat.hf_layer_keeps_cache(modeling_llama.LlamaDecoderLayer)
    assert not _compat.hf_layer_keeps_cache(modeling_layers.GradientCheckpointingLayer)


def test_hf_models_name_their_layer_classes():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    from recomp.torch import _compat

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)
    )
    assert _compat.hf_no_split_modules(model) == {"GPT2Block"}
    assert _compat.hf_no_split_modules(torch.nn.Linear(2, 2)) == frozenset()
