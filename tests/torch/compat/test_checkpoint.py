"""``recomp.torch._compat.checkpoint``: PyTorch's non-reentrant checkpoint from the inside
(its hooks, its frame's save counter and holders, the debug switch), closing one whose
function raised, and PyTorch's checkpoint wrapper taking a module. Each test fails when PyTorch changes what recomp relies on."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

import recomp  # noqa: E402
from recomp.torch import _compat  # noqa: E402


def test_save_counter_follows_the_checkpoint_frame():
    counts = []

    def body(x):
        counter = _compat.checkpoint_save_counter()
        if counter is None or counter() is None:  # the replay: its own hooks on top then
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


def test_debug_switch_reads_the_global_setter():
    tuc = torch.utils.checkpoint
    with tuc.set_checkpoint_debug_enabled(True):
        assert _compat.checkpoint_debug_switch() is True
    assert _compat.checkpoint_debug_switch() is None


def test_top_checkpoint_hooks_are_found_and_can_be_replaced():
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


def test_replay_store_holders_are_the_frames_in_save_order():
    seen = []

    def body(x):
        hooks = _compat.top_checkpoint_hooks()
        store = _compat.replay_store(hooks[0])
        assert store is not None and store.holders() == []
        y = torch.sin(x)  # saves x
        z = torch.tanh(y)  # saves its output
        seen.extend(store.holders())
        return z

    x = torch.randn(3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)
    assert len(seen) == 2 and all(h is not None for h in seen)
    assert len({id(h) for h in seen}) == 2
    del out
    assert _compat.replay_store(lambda t: t) is None  # not a checkpoint's hook


def test_replay_store_gives_what_a_pass_recomputed_and_did_not_read():
    """A pass that computes one gradient of two reads one of the replay's tensors; the
    store hands over the other (and nothing of a pass that read everything)."""
    stores = []

    def body(a, b):
        stores.append(_compat.replay_store(_compat.top_checkpoint_hooks()[0]))
        return (a.sin() * b.cos()).sum()

    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(body, a, b, use_reentrant=False)
    (store,) = stores
    # Only a's gradient: cos's saved input (b) is recomputed too and left unread.
    torch.autograd.grad(out, [a], retain_graph=True)
    leftovers = store.take_leftovers(None)
    assert any(value is not None and torch.equal(value, b) for _, value in leftovers)
    assert all(holder is not None for holder, _ in leftovers)
    assert store.take_leftovers(None) == []  # taken once
    # A full pass reads everything its replay recomputed: nothing is left over.
    out.backward()
    assert store.take_leftovers(None) == []


def test_marks_of_a_checkpoint_hook_are_copied():
    def like(t):
        return t

    like._user_hooks = ("pack", "unpack")

    def hook(t):
        return t

    _compat.mark_as_checkpoint_hook(hook, like)
    assert hook._checkpoint_internal is True
    assert hook._user_hooks == ("pack", "unpack")


class TestFailedCheckpoint:
    """PyTorch 2.9 leaves a non-reentrant checkpoint open when its function raises."""

    def _hooks_left(self):
        return torch._C._autograd._top_saved_tensors_default_hooks(False)

    def test_a_failed_checkpoint_is_closed_from_the_traceback(self):
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


def test_an_early_stop_passes_through_the_replay_context():
    seen = []

    class Watch:
        def __enter__(self):
            return None

        def __exit__(self, *exc_info):
            seen.append(_compat.is_early_stop(exc_info[1]))

    def context_fn():
        return contextlib.nullcontext(), Watch()

    x = torch.randn(3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(
        lambda t: t.sin().cos().exp(), x, use_reentrant=False, context_fn=context_fn
    )
    out.sum().backward()
    assert seen and seen[0] is True  # stopped after the last tensor the backward needs
    assert not _compat.is_early_stop(None) and not _compat.is_early_stop(ValueError())


def made_kwargs(wrapper):
    return dict(wrapper.checkpoint_fn.keywords)


def test_checkpoint_wrapper_is_guarded_with_the_arguments_it_is_given():
    """The guard (installed by ``recomp.torch``) sees the module and the function however
    they are passed, runs before anything is wrapped, and is installed once."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrappers

    import recomp.torch as rt

    init = wrappers.CheckpointWrapper.__init__
    assert _compat.guard_checkpoint_wrapper(lambda module, fn, reentrant: None)  # already there
    assert wrappers.CheckpointWrapper.__init__ is init

    def mine(function, *args, **kwargs):
        return function(*args, **kwargs)

    excluded = rt.checkpoint_exclude_wrapper(torch.nn.Linear(2, 2))
    for build in (
        lambda: wrappers.checkpoint_wrapper(excluded, checkpoint_fn=mine),
        lambda: wrappers.CheckpointWrapper(excluded, wrappers.CheckpointImpl.NO_REENTRANT, mine),
        lambda: wrappers.CheckpointWrapper(excluded, wrappers.CheckpointImpl.REENTRANT),
        lambda: wrappers.checkpoint_wrapper(
            excluded, checkpoint_impl=wrappers.CheckpointImpl.REENTRANT
        ),
    ):
        with pytest.raises(recomp.DoubleCheckpointError):
            build()
    # PyTorch's own non-reentrant checkpoint, however asked for: recomp's checkpoint is
    # put in its place, with the wrapper's keyword arguments.
    for build in (
        lambda: wrappers.checkpoint_wrapper(excluded, preserve_rng_state=False),
        lambda: wrappers.CheckpointWrapper(mod=excluded),
        lambda: wrappers.CheckpointWrapper(excluded, wrappers.CheckpointImpl.NO_REENTRANT),
    ):
        made = build()
        assert made.checkpoint_fn.func is rt.checkpoint
    assert made_kwargs(wrappers.checkpoint_wrapper(excluded, preserve_rng_state=False)) == {
        "preserve_rng_state": False
    }
    # recomp's own function, positionally or by keyword: a recomp checkpoint, accepted.
    by_keyword = wrappers.checkpoint_wrapper(excluded, checkpoint_fn=rt.checkpoint)
    positional = wrappers.CheckpointWrapper(
        excluded, wrappers.CheckpointImpl.NO_REENTRANT, rt.checkpoint
    )
    assert by_keyword._checkpoint_wrapped_module is excluded
    assert positional._checkpoint_wrapped_module is excluded
    # Modules recomp never wrapped, and PyTorch's offload wrapper, are left alone.
    wrappers.checkpoint_wrapper(torch.nn.Linear(2, 2))
    wrappers.offload_wrapper(excluded)
