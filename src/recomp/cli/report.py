"""``recomp report``: run one forward of a model under a strategy and show where its
activation memory goes (``recomp.torch.report.saved_tensors_report``), as a table and a picture.

The model options are those of ``recomp plan`` and ``recomp bench`` (the built-in decoder's
size, or ``--model MODULE:FACTORY``, Hugging Face models included); the strategy is one of
the benchmark's (``none``, ``full``, ``exclude:attn``, ...) or a plan file written by
``recomp plan --json``. The report reads the autograd graph, not the allocator, so it runs
in this process: no child process, no warm-up.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import installs
from .args import CommandParser
from .config import (
    DEFAULT_MODEL,
    MODEL_PROTOCOL,
    BenchConfig,
    add_config_arguments,
    add_model_argument,
    config_from_args,
)
from .plots import write_report_png
from .saved_tensors import REFERENCES, reporter, temporary_compile_cache
from .strategies import Run, parse, refused, report_strategy

PROG = "recomp report"


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="recomp report",
        description=(
            "Run one forward of the model under a checkpointing strategy and print every "
            "storage held for backward, billed once, by layer, excluded region and op, with "
            "why it is held (kept by a region, cached region output, checkpoint input, "
            "offloaded, saved outside checkpoints). --png draws per-layer bars of it."
        ),
        epilog=MODEL_PROTOCOL,
    )
    add_model_argument(
        p,
        "PyTorch model factory (default: the built-in Llama-style decoder; MODULE is "
        "looked for in the current directory too); a Hugging Face PreTrainedModel works as "
        "it is",
    )
    p.add_argument(
        "--strategy",
        default="exclude:attn",
        type=report_strategy,
        metavar="STRATEGY",
        help="none, full, exclude:R, selective, sac:R, every@K, ... (recomp bench --help "
        "lists them), or PLAN.json written by recomp plan --json (default: exclude:attn)",
    )
    p.add_argument(
        "--framework",
        choices=("torch", "mindspore"),
        default="torch",
        help="torch (default) or mindspore: the MindSpore decoder of recomp bench, with "
        "strategies none, full (mindspore.recompute) and exclude:R, recorded during "
        "one step with recomp.mindspore.report.record_saved_tensors",
    )
    p.add_argument("--png", metavar="PATH", help="write per-layer stacked bars here")
    p.add_argument(
        "--summary",
        action="store_true",
        help="one line per layer, region and kind instead of one per storage",
    )
    p.add_argument(
        "--max-rows", type=int, default=None, help="print at most this many rows (largest first)"
    )
    add_config_arguments(p, steps=1, steps_help=argparse.SUPPRESS, device_help="cpu or cuda[:N]")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.strategy.endswith(".json"):
        run: Run = "mindspore" if args.framework == "mindspore" else "eager"
        why = refused(parse(args.strategy), run)
        if why:
            parser.error(why)
    if not installs.check(PROG, [args.framework]):
        return installs.EXIT_MISSING
    config = report_config(args)
    if config is None:
        return 2
    with temporary_compile_cache():
        return run_report(args, config)


def run_report(args: argparse.Namespace, config: BenchConfig) -> int:
    """Report, print and draw; 2 if the strategy or model cannot be reported, 1 if the
    model needs a package that is not installed."""
    report_of, model = reporter(args.framework, config)
    try:
        report = report_of(config, args.strategy)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as exc:
        absent = installs.missing_in(str(exc))
        if absent is not None:
            print(installs.install_line(PROG, absent, f"--model {args.model}"), file=sys.stderr)
            return installs.EXIT_MISSING
        if isinstance(exc, ImportError):
            raise
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print_report(args, report, model)
    if args.png:
        references = {s: report_of(config, s) for s in REFERENCES}
        write_picture(args.png, report, args.strategy, references)
    return 0


def report_config(args: argparse.Namespace) -> BenchConfig | None:
    """The configuration the options describe; None (after saying why) if they do not fit."""
    config = config_from_args(args)
    config.model = args.model
    if args.framework == "mindspore" and config.model != DEFAULT_MODEL:
        print(
            "recomp report: --framework mindspore runs the MindSpore decoder of recomp bench; "
            "--model takes PyTorch factories only",
            file=sys.stderr,
        )
        return None
    return config


def print_report(args: argparse.Namespace, report: Any, model: str) -> None:
    print(f"strategy {args.strategy}, model {model}")
    if args.summary:
        print(report.summary())
    else:
        print(report.format(largest_first=args.max_rows is not None, max_rows=args.max_rows))


def write_picture(path: str, report: Any, strategy: str, references: dict[str, Any]) -> None:
    if write_report_png(path, report, strategy, references):
        print(f"wrote {path}")
    else:
        print("no picture: matplotlib is not installed: " + installs.INSTALLS["matplotlib"][1])
