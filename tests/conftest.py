import importlib.util
import os
import sys

import pytest

# Tests import the helper modules in tests/support (models, memory readers, paths).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))


def pytest_configure(config):  # type: ignore[no-untyped-def]
    # Test files of a framework that is not installed skip themselves (importorskip), so
    # a PyTorch-only environment runs the PyTorch half. Where a framework must be there,
    # name it (RECOMP_TEST_REQUIRE=torch,mindspore): a failing import then stops the run
    # instead of turning into skips.
    for name in filter(None, os.environ.get("RECOMP_TEST_REQUIRE", "").split(",")):
        importlib.import_module(name.strip())
    config.addinivalue_line(
        "markers",
        "replay_differs: the test makes a replay compute other values than its forward on "
        "purpose (RECOMP_TEST_VALUE_CHECK=1 leaves it alone)",
    )
    config.addinivalue_line(
        "markers", "inductor: compiles with torch.compile's inductor backend (builds C++, slow)"
    )
    config.addinivalue_line(
        "markers",
        "system: a whole command, several processes, a compiler backend or a long soak; "
        "run by `make test-system` (and CI), not by `make test`",
    )


# The planner's simulation needs PyTorch 2.13 or newer (recomp.plan.simulate refuses
# older releases): these files test it, and skip on an older PyTorch.
SIMULATION_TESTS = {
    "test_simulate.py",
    "test_simulated_models.py",
    "test_step_peak.py",
    "test_swap_options.py",
    "test_simulate_command.py",
    "test_fit.py",
    "test_collectives_per_layer.py",
    "test_layouts.py",
    "test_simulate_parallel.py",
    "test_kernels.py",
    "test_fake.py",
}


def _simulation_unsupported():  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("torch") is None:
        return None  # the files skip themselves without torch
    from recomp.torch._compat import simulation_unsupported

    return simulation_unsupported()


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    simulation = [item for item in items if item.path.name in SIMULATION_TESTS]
    unsupported = _simulation_unsupported() if simulation else None
    for item in items:
        # Inductor builds C++ for every graph: what it compiles is a system-level test too.
        if item.get_closest_marker("inductor") is not None:
            item.add_marker(pytest.mark.system)
    if unsupported:
        for item in simulation:
            if "refuses_old_pytorch" not in item.name:
                item.add_marker(pytest.mark.skip(reason=unsupported))


@pytest.fixture(autouse=True)
def _mindspore_recovers_after_each_test():
    """The MindSpore bug ``recover_mindspore`` works around, for every test: a test that
    raised inside an ``ms.grad`` forward (through ``pytest.raises``, in any file) would
    make a later test's LayerNorm gradient fail, depending on which tests share a
    process. Clearing the PyNative executor's resources after each test that ran with
    MindSpore imported keeps the tests independent of their order."""
    yield
    if "mindspore" in sys.modules:
        from mindspore.graph.api import _pynative_executor

        _pynative_executor.clear_res()


@pytest.fixture
def recover_mindspore():
    """MindSpore 2.10 bug, independent of recomp: after any exception escapes an
    ms.grad forward (even one with no checkpoint), the next LayerNorm gradient fails
    ("For LayerNormGrad, the index 7 is out of range"). Clearing the PyNative
    executor's resources restores it; tests that raise inside ms.grad use this."""
    yield
    from mindspore.graph.api import _pynative_executor

    _pynative_executor.clear_res()


@pytest.fixture
def seeded():
    """Tests that call mindspore.set_seed leave MindSpore's global seed, kernel seeds,
    generator and NumPy's state as they found them."""
    import mindspore as ms
    import numpy as np

    seed = sys.modules["mindspore.common.seed"]
    saved = (seed._GLOBAL_SEED, dict(seed._KERNEL_SEED), np.random.get_state())
    generator = ms.get_rng_state()
    yield
    seed._GLOBAL_SEED = saved[0]
    seed._KERNEL_SEED.clear()
    seed._KERNEL_SEED.update(saved[1])
    np.random.set_state(saved[2])
    ms.set_rng_state(generator)


@pytest.fixture(params=["torch", "mindspore"])
def fw(request):
    """The framework adapter (``tests/support/frameworks.py``) of a test written once for both."""
    pytest.importorskip(request.param)
    import frameworks

    return frameworks.ADAPTERS[request.param]()


@pytest.fixture
def recover(fw, request):
    """``recover_mindspore`` for the MindSpore run of a test written for both frameworks
    that raises inside a gradient computation."""
    if fw.name == "mindspore":
        request.getfixturevalue("recover_mindspore")


@pytest.fixture(autouse=True)
def _values_check_everywhere(monkeypatch, request):
    """``RECOMP_TEST_VALUE_CHECK=1``: every PyTorch checkpoint that does not set
    ``determinism_check`` runs with ``"values"``, so that the whole suite shows the check
    raises nowhere a replay is right (excluded regions, early stop, kept replays, nested
    checkpoints). Tests marked ``replay_differs`` make a wrong replay on purpose (a
    control that turns a mechanism off): the check would rightly raise there."""
    wrong_on_purpose = request.node.get_closest_marker("replay_differs") is not None
    if os.environ.get("RECOMP_TEST_VALUE_CHECK") != "1" or wrong_on_purpose:
        yield
        return
    api = importlib.import_module("recomp.torch._api")
    original = api.value_check_option

    def always_on(kwargs, *, debug, name, compiled=False):  # type: ignore[no-untyped-def]
        kwargs.setdefault("determinism_check", "values")
        return original(kwargs, debug=debug, name=name, compiled=compiled)

    monkeypatch.setattr(api, "value_check_option", always_on)
    yield
