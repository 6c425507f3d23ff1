"""Run PyTorch's own checkpoint tests with recomp's checkpoint in place of PyTorch's.

Point it at the test files of a PyTorch source checkout of the version you run::

    pip install expecttest pytest          # what torch.testing._internal imports
    python tools/torch_checkpoint_suite.py ~/pytorch/test/test_autograd.py \\
        ~/pytorch/test/test_utils.py

Every ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` the tests make
(directly, through ``checkpoint_sequential``, through the name a test module imported, or
through PyTorch's ``checkpoint_wrapper`` / ``apply_activation_checkpointing`` with
``CheckpointImpl.NO_REENTRANT``, which call it under a name of their own) goes to
``recomp.torch.checkpoint``; reentrant calls stay PyTorch's. The wrapper's tests run the
same way::

    python tools/torch_checkpoint_suite.py \\
        ~/pytorch/test/distributed/fsdp/test_checkpoint_wrapper.py

A module that bound PyTorch's function under a name of its own before the replacement
(imported by a conftest or a plugin) is rebound to the router too; one imported later binds
the router itself. Hugging Face transformers' ``modeling_utils`` is such a module (its
``testing_utils`` imports it), so its gradient-checkpointing tests run the same way, from a
transformers checkout whose version matches the installed one::

    python tools/torch_checkpoint_suite.py tests/models/llama/test_modeling_llama.py \\
        -k gradient_checkpointing

``--plain`` runs the same selection without the replacement, to tell PyTorch's own failures on this machine
from recomp's. By default only tests whose name mentions checkpointing are collected
(``-k``; a file whose name mentions it, as the wrapper's does, is collected whole);
anything after ``--`` goes to pytest.

Where recomp differs from PyTorch on purpose, the test is marked as an expected failure
with the reason (``DIFFERENCES``): with the replacement it must still fail, or the
difference is gone and the entry should go too.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

#: Tests of PyTorch's suite that recomp fails on purpose, and why.
DIFFERENCES = {
    "test_checkpoint_detects_non_determinism": (
        "with debug=True recomp prints its own log of the forward's and the replay's ops "
        "(PyTorch's debug mode refuses the context_fn recomp always passes); the test "
        "reads PyTorch's wording"
    ),
}

DEFAULT_SELECTION = "checkpoint or Checkpoint or checkpointing"

#: Where PyTorch's checkpoint_wrapper keeps the checkpoint function it calls by default.
WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
WRAPPER_NAME = "torch_utils_checkpoint"


def rebind_early_bindings(original: Any, replacement: Any) -> list[str]:
    """Point every module-level name bound to ``original`` at ``replacement``, in the
    modules imported so far, except recomp's own; return the names, as ``module.name``."""
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module_name == "recomp" or module_name.startswith("recomp."):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, replacement)
                rebound.append(f"{module_name}.{name}")
    return rebound


class RoutePlugin:
    """A pytest plugin: the replacement is made at configure time, before any test module
    imports ``checkpoint`` from ``torch.utils.checkpoint``."""

    def __init__(self, route: bool) -> None:
        self.route = route
        self.calls = {"recomp": 0, "torch": 0, "wrapper": 0}
        self.rebound: list[str] = []

    def pytest_configure(self, config: Any) -> None:
        if not self.route:
            return
        import torch.utils.checkpoint as tuc

        import recomp.torch  # first: recomp binds PyTorch's checkpoint as it is now

        torch_checkpoint = tuc.checkpoint
        calls = self.calls

        def routed(function: Any, *args: Any, use_reentrant: bool | None = None, **kwargs: Any) -> Any:
            if use_reentrant is False:
                calls["recomp"] += 1
                return recomp.torch.checkpoint(function, *args, use_reentrant=False, **kwargs)
            calls["torch"] += 1
            if use_reentrant is not None:
                kwargs["use_reentrant"] = use_reentrant
            return torch_checkpoint(function, *args, **kwargs)

        tuc.checkpoint = routed  # type: ignore[assignment]

        # PyTorch's checkpoint_wrapper binds the function under its own name when its
        # module is imported (which a conftest may have done already): its default
        # checkpoint (CheckpointImpl.NO_REENTRANT / REENTRANT) goes through the same router.
        try:
            wrappers = importlib.import_module(WRAPPER_MODULE)
        except ImportError:  # a build without torch.distributed
            wrappers = None
        if wrappers is not None and callable(getattr(wrappers, WRAPPER_NAME, None)):

            def through_wrapper(function: Any, *args: Any, **kwargs: Any) -> Any:
                calls["wrapper"] += 1
                return routed(function, *args, **kwargs)

            setattr(wrappers, WRAPPER_NAME, through_wrapper)

        # Modules imported before this point (by a conftest, or by the packages pytest
        # loads) that bound PyTorch's function under a name of their own, as
        # ``from torch.utils.checkpoint import checkpoint`` does: Hugging Face
        # transformers' modeling_utils, which its testing_utils imports. Modules
        # imported later bind the router itself. recomp's own binding stays PyTorch's.
        self.rebound = rebind_early_bindings(torch_checkpoint, routed)

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        if not self.route:
            return
        import pytest

        for item in items:
            reason = DIFFERENCES.get(item.originalname if hasattr(item, "originalname") else item.name)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.route:
            terminalreporter.write_line(
                f"checkpoint calls: {self.calls['recomp']} to recomp, "
                f"{self.calls['torch']} reentrant ones to PyTorch; "
                f"{self.calls['wrapper']} of all these through PyTorch's checkpoint_wrapper"
            )
            if self.rebound:
                terminalreporter.write_line(
                    "names bound to PyTorch's checkpoint before the replacement, rebound: " + ", ".join(self.rebound)
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="test files of a PyTorch source checkout")
    parser.add_argument("--plain", action="store_true", help="PyTorch's checkpoint, unreplaced")
    parser.add_argument("-k", default=DEFAULT_SELECTION, help="pytest's test selection")
    args, extra = parser.parse_known_args(argv)
    import pytest

    plugin = RoutePlugin(route=not args.plain)
    extra = [a for a in extra if a != "--"]
    return int(pytest.main([*args.files, "-k", args.k, "-p", "no:cacheprovider", *extra], plugins=[plugin]))


if __name__ == "__main__":
    sys.exit(main())
