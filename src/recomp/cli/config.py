"""The configuration of a measurement and model loading, shared by the parent and child
processes, and the command-line options that make a configuration (``recomp bench``,
``recomp plan``, ``recomp report``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DEFAULT_MODEL = "recomp.cli.torch.models:llama"

# What `--help` of `recomp bench` and `recomp plan` says a model factory must provide; the
# code is recomp.plan.modelcall (input, loss) and recomp.plan.profiler.find_layers (layers).
MODEL_PROTOCOL = (
    "Model factories (--model MODULE:FACTORY): FACTORY takes those of the keyword arguments "
    "layers, hidden, heads, seq, batch that it declares and returns a torch nn.Module, for "
    "example a Hugging Face PreTrainedModel such as LlamaForCausalLM or Qwen3ForCausalLM "
    "built from a config. Layers (the checkpoint units): model.layers, or the one "
    "nn.ModuleList named `layers` below the model (model.model.layers of a Hugging Face "
    "causal LM), or else the modules whose classes a Hugging Face model's _no_split_modules "
    "names. Input: model.example_input(batch, seq, generator) if the model defines it; for a "
    "Hugging Face model, keyword arguments input_ids (torch.long, shape (batch, seq), "
    "uniform in [0, vocab_size) of its config), labels=input_ids and use_cache=False; "
    "otherwise a float tensor (batch, seq, hidden). Loss: model.loss(output) if defined; for "
    "a Hugging Face model, the loss it computes from the labels (output.loss: a head that "
    "takes labels, such as *ForCausalLM); otherwise the mean square of the output."
)


@dataclass
class BenchConfig:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    batch: int = 2
    steps: int = 10
    warmup: int = 1
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    # torch.compile backend ("inductor", "aot_eager") for compiled runs; None: eager.
    compile: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        return cls(**data)


# Fields the command line does not set directly: ``compile`` makes a second, compiled
# configuration next to the eager one; ``extra`` carries plans and per-command settings.
_NOT_FROM_ARGS = ("compile", "extra", "seed")


def add_config_arguments(
    parser: argparse.ArgumentParser, *, steps: int, steps_help: str, device_help: str
) -> None:
    """The options both commands share: model size, timed steps, device, threads."""
    parser.add_argument("--layers", type=int, default=BenchConfig.layers)
    parser.add_argument("--hidden", type=int, default=BenchConfig.hidden)
    parser.add_argument("--heads", type=int, default=BenchConfig.heads)
    parser.add_argument("--seq", type=int, default=BenchConfig.seq)
    parser.add_argument("--batch", type=int, default=BenchConfig.batch)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--device", default=BenchConfig.device, help=device_help)
    parser.add_argument(
        "--threads", type=int, default=BenchConfig.threads, help="intra-op threads per process"
    )


def config_from_args(args: argparse.Namespace, **extra: Any) -> BenchConfig:
    """The configuration the parsed options describe: every field of ``BenchConfig`` that
    the parser defines (the others keep their defaults), with ``extra`` as its extras."""
    values = {
        f.name: getattr(args, f.name)
        for f in fields(BenchConfig)
        if f.name not in _NOT_FROM_ARGS and hasattr(args, f.name)
    }
    return BenchConfig(**values, extra=dict(extra))


def row_label(framework: str, config: dict[str, Any]) -> str:
    """The framework column of a result: ``torch``, or ``torch+inductor`` when compiled."""
    backend = config.get("compile")
    return f"{framework}+{backend}" if backend else framework


def intermediate_size(hidden: int) -> int:
    """Llama's MLP width: 2/3 of 4 * hidden, rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * hidden / 3 / 64)


def add_model_argument(parser: argparse.ArgumentParser, help: str, name: str = "--model") -> None:
    """``--model MODULE:FACTORY`` of every command, resolved alike (:func:`model_spec`)."""
    default = DEFAULT_MODEL if name == "--model" else None
    parser.add_argument(name, default=default, type=model_spec, metavar="MODULE:FACTORY", help=help)


def model_spec(text: str) -> str:
    """``--model`` as argparse reads it: ``MODULE:FACTORY`` whose module can be found from
    here (the current directory first, as ``python -m`` finds modules), checked without
    importing it; a usage error otherwise."""
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise argparse.ArgumentTypeError(
            f"takes MODULE:FACTORY (mymodels:build for build() in ./mymodels.py), got {text!r}"
        )
    with_current_directory()
    top = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise argparse.ArgumentTypeError(
            f"{text}: no module {top!r} in the current directory ({os.getcwd()}) or on "
            "the import path (PYTHONPATH)"
        )
    return text


def with_current_directory() -> None:
    """Put the current directory on the import path if it is not there (a console script
    starts with its own directory there instead), so that ``--model mymodels:build``
    finds ``./mymodels.py`` in every command and in the child processes alike."""
    here = os.getcwd()
    if not any(os.path.abspath(p or ".") == here for p in sys.path):
        sys.path.insert(0, here)


def load_factory(spec: str) -> Any:
    """``"package.module:factory"`` -> the factory callable (the module looked for in the
    current directory too)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model takes MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    with_current_directory()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"--model {spec}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
            "the module must be importable from here (the current directory or PYTHONPATH)"
        ) from exc
    factory = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as exc:
            raise ValueError(f"--model {spec}: {module_name!r} has no {attr!r}") from exc
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable")
    return factory


class FactoryError(ValueError):
    """The model factory raised: its message says what, where and in which factory."""


def call_factory(factory: Any, config: BenchConfig) -> Any:
    """Call ``factory`` with the size options it declares (layers, hidden, heads, seq, batch).

    An exception from the factory becomes a :class:`FactoryError` that shows its type,
    its message and where it was raised, since the command prints one line for it."""
    options = {
        "layers": config.layers,
        "hidden": config.hidden,
        "heads": config.heads,
        "seq": config.seq,
        "batch": config.batch,
    }
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = None
    if params is None:
        chosen: dict[str, Any] = {}
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        chosen = options
    else:
        chosen = {k: v for k, v in options.items() if k in params}
    try:
        return factory(**chosen)
    except Exception as exc:
        raise FactoryError(_factory_failure(factory, chosen, exc)) from exc


def _factory_failure(factory: Any, options: dict[str, Any], exc: Exception) -> str:
    """Type and place first: a child process's report keeps only the start of a long line."""
    name = f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', factory)}"
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is call_factory's call
    where = ""
    if frames:
        raised = frames[-1]
        where = f" at {raised.filename}:{raised.lineno} in {raised.name}"
        called_from = frames[0]  # the factory's own line, when it raised further down
        if called_from is not raised:
            where += f" (from {called_from.filename}:{called_from.lineno} in {called_from.name})"
    called = ", ".join(f"{k}={v}" for k, v in options.items())
    return (
        f"model factory {name} raised {type(exc).__name__}{where}: {exc} "
        f"(called with {called or 'no arguments'}; fix the factory or pass another --model)"
    )
