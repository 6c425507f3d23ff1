"""``recomp.torch._compat.dispatch``: dispatch modes, operator schemas and names, and FLOPs
per operator. Each test fails when PyTorch changes what recomp relies on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402
from recomp.torch._compat import TorchDispatchMode  # noqa: E402


def test_op_arguments_name_what_an_operator_writes():
    ops = torch.ops
    assert _compat.op_arguments(ops._c10d_functional.all_reduce_.default) == (
        ("input", True),
        ("reduce_op", False),
        ("group_name", False),
    )
    assert _compat.op_arguments(ops._c10d_functional.all_gather_into_tensor.default)[0] == (
        "input",
        False,
    )
    # The classic operators carry no annotation; recomp knows they write their first one.
    assert _compat.op_arguments(ops.c10d.allreduce_.default)[0] == ("tensors", False)


def test_version_sharing_detach_sees_in_place_changes_below_autograd():
    detach = _compat.version_sharing_detach()
    assert detach is not None
    aliases = []

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.sin.default:
                aliases.append((detach(out), out.detach()))
            return out

    with Keep():
        y = torch.sin(torch.randn(3))
    shared, plain = aliases[0]
    before = shared._version
    y.add_(1)
    assert shared._version == before + 1
    assert plain._version == before  # why the guard is needed
    assert torch.equal(shared, y)


def test_completed_work_can_be_waited_on():
    make = _compat.completed_work_factory()
    assert make is not None
    work = make([torch.ones(2)])
    assert isinstance(work, torch.ScriptObject)
    unboxed = torch.distributed.Work.unbox(work)
    assert unboxed.is_completed() and unboxed.wait()


def test_selective_checkpoint_modes_are_hidden_and_restored():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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


def test_registered_modes_are_hidden_with_selective_checkpointing():
    from torch.utils import _python_dispatch

    class Tap(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    _compat.register_selective_mode_type(Tap)
    stack = _python_dispatch._get_current_dispatch_mode_stack
    with Tap():
        assert len(stack()) == 1
        with _compat.hide_selective_checkpoint_modes():
            assert len(stack()) == 0
        assert len(stack()) == 1


def test_dispatch_mode_base_and_op_names():
    assert issubclass(_compat.TorchDispatchMode, object)
    seen = []

    class Names(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(_compat.op_name(func))
            return func(*args, **(kwargs or {}))

    with Names():
        torch.sin(torch.randn(2))
    assert "aten::sin" in seen


def test_cpu_attention_ops_exist():
    assert _compat.cpu_attention_ops() is not None


def test_op_flop_counter_hands_each_counted_op_to_on_op():
    seen = []

    class Counter(_compat.op_flop_counter()):
        def on_op(self, func_packet, flops):
            seen.append((func_packet, flops))

    with Counter(display=False) as counter:
        torch.mm(torch.randn(2, 3), torch.randn(3, 4))
        torch.sin(torch.randn(2))  # no formula: not handed on
    assert seen == [(torch.ops.aten.mm, 2 * 2 * 3 * 4)]
    assert counter.get_total_flops() == 2 * 2 * 3 * 4  # FlopCounterMode still counts
