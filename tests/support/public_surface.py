"""What the public-surface tests compare against, written down independently of the code:
HyperParallel's activation-memory names (``hyper_parallel.core.activation_memory.api``,
whose own unit test asserts this list, and three names of its swap module), and the
table of moved names as the reference documents it (docs/reference/index.md)."""

from __future__ import annotations

import re

import paths

#: hyper_parallel.core.activation_memory.api.__all__
HYPERPARALLEL_API = [
    "CheckpointPolicy",
    "checkpoint",
    "swap",
    "checkpoint_wrapper",
    "checkpoint_exclude_wrapper",
    "swap_wrapper",
    "swap_tensor_wrapper",
    "recompute_handle_collector_ctx",
    "recompute_handle",
    "recompute_session_ctx",
    "clear_recompute_session",
    "ignore_sac_ops",
    "create_selective_checkpoint_contexts",
    "create_native_selective_checkpoint_contexts",
    "async_save_on_cpu",
    "get_class_activation_wrapper",
    "noop_context_fn",
    "is_compiling",
]
#: from hyper_parallel.core.activation_memory.swap
HYPERPARALLEL_SWAP = ["SwapManager", "PinnedMemoryPool", "AsyncSaveOnCpu"]
#: the declarative recompute regions: RecomputePolicy (hyper_parallel.models.adapter_spec),
#: ActivationCheckpointSelection (hyper_parallel.trainer.config.parallelism), recomp's
#: name for what HyperParallel's trainer does with them, and the public helper of
#: hyper_parallel.distributed.activation_checkpoint that wraps a layer's parts
HYPERPARALLEL_REGIONS = [
    "RecomputePolicy",
    "ActivationCheckpointSelection",
    "apply_recompute_policy",
    "apply_submodule_checkpointing",
]

REFERENCE_INDEX = paths.DOCS / "reference" / "index.md"
_ROW = re.compile(r"^\| `(recomp\.[\w.]+)` \| `(recomp\.[\w.]+)` \|\s*$", re.M)


def documented_moves() -> dict[str, str]:
    """The "Moved names" table of the reference: old dotted name -> new dotted name."""
    text = REFERENCE_INDEX.read_text()
    section = text.split("\n## Moved names\n", 1)[1]
    return dict(_ROW.findall(section))


def moves_of(package: str) -> dict[str, str]:
    """The documented moves out of ``package``: old attribute name -> new dotted name."""
    return {
        old.rpartition(".")[2]: new
        for old, new in documented_moves().items()
        if old.rpartition(".")[0] == package
    }


def expected_message(package: str, name: str, new: str) -> str:
    return f"{package}.{name} moved to {new}; the old name goes away in the next release."


def new_object(new: str) -> object:
    import importlib

    module, _, name = new.rpartition(".")
    return getattr(importlib.import_module(module), name)


def assert_moved(package: str, name: str, new: str) -> None:
    """``package.name`` is ``new``'s object, and each access warns once, from the caller's
    line, with the documented text; ``from package import name`` warns once too."""
    import importlib
    import warnings

    module = importlib.import_module(package)
    want = new_object(new)
    text = expected_message(package, name, new)
    for _ in range(2):  # every access warns, not only the first
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = getattr(module, name)
        assert got is want
        assert [(w.category, str(w.message)) for w in seen] == [(DeprecationWarning, text)]
        assert seen[0].filename == __file__, "the warning points at the caller's line"
    code = compile(f"from {package} import {name} as got\n", "<user code>", "exec")
    scope: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(code, scope)
    assert scope["got"] is want
    assert [(w.category, str(w.message), w.filename) for w in seen] == [
        (DeprecationWarning, text, "<user code>")
    ]
    assert name not in module.__all__


def assert_star_import_is_quiet(package: str) -> None:
    """``from package import *`` brings exactly ``__all__`` and warns about nothing."""
    import importlib
    import warnings

    module = importlib.import_module(package)
    scope: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(f"from {package} import *", scope)
    assert [str(w.message) for w in seen if "recomp" in str(w.message)] == []
    assert set(scope) - {"__builtins__"} == set(module.__all__)
