"""One test per use of a framework's private API (``recomp/*/_compat.py``).

Each fails when the framework changes what recomp relies on, so an upgrade
shows which workaround to revisit; and no recomp module outside the compat
modules touches private API (``tools/check_private_api.py``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
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
