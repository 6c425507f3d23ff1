"""``recomp.torch._compat.engine``: storage identity, version counters and the autograd
engine queries. Each test fails when PyTorch changes what recomp relies on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402


def test_storage_key_is_shared_by_views_and_differs_between_storages():
    a = torch.randn(4, 6)
    assert _compat.storage_key(a) == _compat.storage_key(a.t()[1:])
    assert _compat.storage_key(a) == _compat.storage_key(a.view(24))
    assert _compat.storage_key(a) != _compat.storage_key(a.clone())
    assert isinstance(_compat.storage_key(a), int)  # the _cdata path, not the fallback


def test_version_counts_in_place_changes():
    t = torch.zeros(3)
    before = _compat.version(t)
    t.add_(1)
    assert _compat.version(t) == before + 1
    with torch.inference_mode():
        assert _compat.version(torch.zeros(1)) is None


def test_view_base_is_the_root_of_a_view_chain():
    w = torch.nn.Parameter(torch.randn(3, 4))
    assert _compat.view_base(w) is None
    assert _compat.view_base(w.t().t()) is w


def probe(in_backward):
    """An identity autograd function whose backward calls ``in_backward()`` first."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            in_backward()
            return g

    return Probe


def test_in_backward_is_true_only_inside_a_backward():
    seen = []
    Probe = probe(lambda: seen.append(_compat.in_backward()))
    x = torch.randn(2, requires_grad=True)
    assert not _compat.in_backward()
    Probe.apply(x).sum().backward()
    assert seen == [True]


def test_at_pass_end_runs_when_its_own_pass_ends():
    events = []

    def in_backward():
        task = _compat.graph_task_id()
        assert _compat.at_pass_end(lambda: events.append(("end", task)))
        if not events:  # the outer pass: a pass run from here ends before it
            events.append(("nested from", task))
            with torch.enable_grad():
                Probe.apply(x * 1).sum().backward()
            events.append(("back in", task))

    Probe = probe(in_backward)
    x = torch.randn(2, requires_grad=True)
    assert not _compat.at_pass_end(lambda: events.append("outside"))
    Probe.apply(x * 1).sum().backward()
    outer, inner = events[0][1], events[1][1]
    assert inner != outer
    assert events == [("nested from", outer), ("end", inner), ("back in", outer), ("end", outer)]


def test_node_finishes_in_this_pass_follows_the_pass_inputs():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, g):
            seen.append(_compat.node_finishes_in_this_pass())
            return g, g

    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    out = Probe.apply(x * 1, w * 1).sum()
    torch.autograd.grad(out, [x], retain_graph=True)  # w's branch is left for later
    out.backward(retain_graph=True)  # every branch
    torch.autograd.grad(out, [x, w])  # leaves captured by autograd.grad: computed
    assert seen == [False, True, True]
    assert _compat.node_finishes_in_this_pass()  # outside backward


def _model() -> torch.nn.Module:
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), shared, torch.nn.Sequential(shared)
    )
    model.register_module("empty", None)
    model[0].bias.requires_grad_(False)
    return model


def test_module_children_and_parameters_match_the_public_iterators():
    model = _model()
    for module in model.modules():
        assert _compat.module_children(module) == list(module.named_children())
        assert [id(p) for p in _compat.module_parameters(module)] == [
            id(p) for p in module.parameters()
        ]


def test_module_attributes_match_getattr():
    class Custom(torch.nn.Module):
        running_var = None  # a class attribute: getattr finds it before the buffers

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(1))
            self.plain = torch.ones(1)

        def __getattr__(self, name: str) -> object:
            if name == "num_batches_tracked":
                return "forwarded"
            return super().__getattr__(name)

    names = ("running_mean", "running_var", "num_batches_tracked", "plain", "missing")
    for module in (*_model().modules(), Custom()):
        got = _compat.module_attributes(module, names)
        assert [id(x) for x in got] == [id(getattr(module, n, None)) for n in names]


def test_pass_keeps_graph_follows_retain_graph():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(_compat.pass_keeps_graph())
            return g

    x = torch.randn(3, requires_grad=True)
    y = Probe.apply(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch.autograd.grad(Probe.apply(x).sum(), [x])
    assert seen == [True, False, False]
    assert _compat.pass_keeps_graph() is True  # outside backward
