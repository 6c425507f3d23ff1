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


# -- layouts (NOTE [ Calls after the first: layouts ] in recomp._module_state) ----------

_MARKER = "_test_marker"


class _Pair(torch.nn.Module):
    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3, bias=plain)  # a bias slot that holds None
        if not plain:
            self.register_buffer("scale", torch.ones(3))
        self.act = torch.nn.GELU()


def _layout_of(root: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> object:
    walked = [(m, m in skip) for m in root.modules()]
    layout = _compat.tree_layout(walked, _MARKER)
    assert layout is not None
    return layout


def _tensors_of(root: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> list:
    return [t for m in root.modules() if m not in skip for _, t, _ in _compat.module_tensors(m)]


def _swap_children(root: torch.nn.Module) -> None:
    root.a, root.b = root.b, root.a  # both modules stay alive; the names keep their order


_CHANGES = {
    "a parameter added": lambda r: r.act.register_parameter("p", torch.nn.Parameter(torch.ones(1))),
    "a parameter removed": lambda r: r.a._parameters.pop("bias"),
    "a parameter renamed": lambda r: r.a._parameters.__setitem__("w", r.a._parameters.pop("weight")),
    "a parameter frozen": lambda r: r.a.weight.requires_grad_(False),
    "a module replaced": lambda r: setattr(r, "a", torch.nn.Linear(3, 3)),
    "two modules swapped": _swap_children,
    # The same modules in the same order, under other parents:
    "a module moved": lambda r: setattr(r.a, "moved", r._modules.pop("act")),
    "a module added": lambda r: setattr(r.act, "inner", torch.nn.Identity()),
    "a buffer registered": lambda r: r.act.register_buffer("s", torch.ones(1)),
    "a module marked": lambda r: setattr(r.a, _MARKER, object()),
    "a dictionary replaced": lambda r: r.act.__dict__.__setitem__("_parameters", None),
}


@pytest.mark.parametrize("plain", [True, False], ids=["parameters", "with-buffers"])
@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_a_layout_reads_the_tensors_until_the_tree_changes(plain: bool, change: str) -> None:
    root = _Pair(plain)
    layout = _layout_of(root)
    found = _compat.layout_tensors(layout)
    assert found is not None
    assert [id(t) for t in found] == [id(t) for t in _tensors_of(root)]
    assert _compat.layout_versions(layout, found) == _compat.versions(found)
    _CHANGES[change](root)
    assert _compat.layout_tensors(layout) is None


@pytest.mark.parametrize("plain", [True, False], ids=["parameters", "with-buffers"])
def test_a_layout_skips_the_marked_modules_until_one_is_unmarked(plain: bool) -> None:
    root = _Pair(plain)
    setattr(root.a, _MARKER, object())
    layout = _layout_of(root, skip=(root.a,))
    found = _compat.layout_tensors(layout)
    assert found is not None
    assert [id(t) for t in found] == [id(t) for t in _tensors_of(root, skip=(root.a,))]
    delattr(root.a, _MARKER)
    assert _compat.layout_tensors(layout) is None


@pytest.mark.parametrize("plain", [True, False], ids=["parameters", "with-buffers"])
def test_a_layout_of_modules_that_died_reads_nothing(plain: bool) -> None:
    root = _Pair(plain)
    layout = _layout_of(root)
    del root
    assert _compat.layout_tensors(layout) is None
    assert _compat.layout_versions(layout, []) is None


def test_layout_versions_are_read_while_the_modules_hold_the_same_tensors() -> None:
    root = _Pair(True)
    layout = _layout_of(root)
    found = _compat.layout_tensors(layout)
    assert found is not None
    with torch.no_grad():
        root.a.weight.add_(1)
    assert _compat.layout_versions(layout, found) == _compat.versions(found)
    # Another tensor in a slot: the layout holds (it reads what the modules hold now), the
    # versions of what a call read before are not read.
    root.a.weight = torch.nn.Parameter(root.a.weight.detach().clone())
    assert _compat.layout_versions(layout, found) is None
    now = _compat.layout_tensors(layout)
    assert now is not None and now[0] is root.a.weight
