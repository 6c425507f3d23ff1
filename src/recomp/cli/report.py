"""``recomp report``: run one forward of a model under a strategy and show where its
activation memory goes (``recomp.torch.saved_tensors_report``), as a table and a picture.

The model options are those of ``recomp plan`` and ``recomp bench`` (the built-in decoder's
size, or ``--model MODULE:FACTORY``, Hugging Face models included); the strategy is one of
the benchmark's (``none``, ``full``, ``exclude-attn``, ...) or a plan file written by
``recomp plan --json``. The report reads the autograd graph, not the allocator, so it runs
in this process: no child process, no warm-up.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from typing import Any

from .config import (
    DEFAULT_MODEL,
    MODEL_PROTOCOL,
    BenchConfig,
    add_config_arguments,
    config_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recomp report",
        description=(
            "Run one forward of the model under a checkpointing strategy and print every "
            "storage held for backward, billed once, by layer, excluded region and op, with "
            "why it is held (kept by a region, cached region output, checkpoint input, "
            "offloaded, saved outside checkpoints). --png draws per-layer bars of it."
        ),
        epilog=MODEL_PROTOCOL,
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="PyTorch model factory MODULE:FACTORY (default: the built-in Llama-style "
        "decoder); a Hugging Face PreTrainedModel works as it is",
    )
    p.add_argument(
        "--strategy",
        default="exclude-attn",
        help="none, full, exclude-REGION, sac, every@K, ... (see recomp bench --help), or "
        "PLAN.json written by recomp plan --json (default: exclude-attn)",
    )
    p.add_argument(
        "--framework",
        choices=("torch", "mindspore"),
        default="torch",
        help="torch (default) or mindspore: the MindSpore decoder of recomp bench, with "
        "strategies none, full (mindspore.recompute) and exclude-REGION, recorded during "
        "one step with recomp.mindspore.record_saved_tensors",
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
    config = config_from_args(args)
    config.model = args.model
    report_of, model = _reporter(args.framework, config)
    if args.framework == "mindspore" and config.model != DEFAULT_MODEL:
        print(
            "recomp report: --framework mindspore runs the MindSpore decoder of recomp bench; "
            "--model takes PyTorch factories only",
            file=sys.stderr,
        )
        return 2
    try:
        report = report_of(config, args.strategy)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"recomp report: {exc}", file=sys.stderr)
        return 2
    print(f"strategy {args.strategy}, model {model}")
    if args.summary:
        print(report.summary())
    else:
        print(report.format(largest_first=args.max_rows is not None, max_rows=args.max_rows))
    if args.png:
        references = {s: report_of(config, s) for s in ("none", "full")}
        if not write_png(args.png, report, args.strategy, references):
            print("no picture: matplotlib is not installed (pip install recomp[bench])")
            return 0
        print(f"wrote {args.png}")
    return 0


def strategy_report(config: BenchConfig, strategy: str) -> Any:
    """One forward of ``config``'s model under ``strategy`` (a benchmark strategy or a plan
    file), its report taken before backward; the backward then runs, as in training."""
    from recomp.torch import label_layers, saved_tensors_report

    from .._modelcall import call_model
    from .runner import build, plan_for
    from .strategies import layers_of, parse, prepare

    model, x, loss_fn = build(config)
    if strategy.endswith(".json"):
        from recomp.plan import load_plan

        if not os.path.exists(strategy):
            raise FileNotFoundError(f"plan file {strategy!r} not found")
        prepared = prepare(f"plan@{os.path.basename(strategy)}", model, load_plan(strategy))
    elif parse(strategy)[0] == "plan":  # plan@BUDGET: profiled and planned here
        prepared = prepare(strategy, model, plan_for(config, strategy, model, x, loss_fn))
    else:
        prepared = prepare(strategy, model)
    model = prepared.model
    model.train()
    # Layers without a checkpoint are named through hooks; checkpointed ones by their checkpoint.
    with warnings.catch_warnings(), label_layers(model, [path for path, _ in layers_of(model)]):
        # label_layers' hook only names layers; what selective checkpoints keep is found
        # without it, so PyTorch's notice about such hooks around them does not apply.
        warnings.filterwarnings(
            "ignore", message="A saved_tensors_hooks context", category=FutureWarning
        )
        loss = loss_fn(call_model(model, x))
    report = saved_tensors_report(loss, model=model, inputs=x)
    loss.backward()
    return report


def _reporter(framework: str, config: BenchConfig) -> tuple[Any, str]:
    """The report function of ``framework`` and the name of the model it reports on."""
    if framework == "torch":
        return strategy_report, config.model
    return mindspore_strategy_report, "MindSpore decoder of recomp bench"


def mindspore_strategy_report(config: BenchConfig, strategy: str) -> Any:
    """One training step of the MindSpore decoder under ``strategy`` (after a warm-up
    step), recorded by ``recomp.mindspore.record_saved_tensors``."""
    from recomp.mindspore import record_saved_tensors

    from .ms_runner import Trainer, setup

    setup(config)
    trainer = Trainer(config, strategy)
    trainer.step()
    layers = [f"layers.{i}" for i in range(len(trainer.model.layers))]
    with record_saved_tensors(trainer.model, inputs=trainer.x, layers=layers) as record:
        trainer.step()
    return record.report


def write_strategy_reports(
    directory: str, config: BenchConfig, strategies: list[str], framework: str = "torch"
) -> list[str]:
    """For ``recomp bench --report``: ``report-<strategy>.txt`` and ``.png`` per strategy in
    ``directory`` (``report-mindspore-<strategy>`` for MindSpore); returns the paths
    written (no pictures without matplotlib)."""
    os.makedirs(directory, exist_ok=True)
    report_of, model = _reporter(framework, config)
    prefix = "report-" if framework == "torch" else "report-mindspore-"
    references = {s: report_of(config, s) for s in ("none", "full")}
    written = []
    for strategy in strategies:
        report = references[strategy] if strategy in references else report_of(config, strategy)
        stem = os.path.join(directory, prefix + re.sub(r"[^A-Za-z0-9_.-]+", "_", strategy))
        with open(stem + ".txt", "w") as f:
            f.write(f"strategy {strategy}, model {model}\n{report.format()}\n")
        written.append(stem + ".txt")
        if write_png(stem + ".png", report, strategy, references):
            written.append(stem + ".png")
    return written


#: Colours of the kinds in the picture (the report's kinds, in billing order).
_COLOURS = {
    "kept by region": "#1f77b4",
    "offloaded (host)": "#9edae5",
    "cached output": "#ff7f0e",
    "kept by selective checkpoint": "#9467bd",
    "checkpoint input": "#2ca02c",
    "replayed, awaiting backward": "#bcbd22",
    "saved outside checkpoints": "#7f7f7f",
    "saved by a compiled graph": "#17becf",
    "other saved-tensor hook": "#8c564b",
    "random state (host)": "#e377c2",
}


def write_png(path: str, report: Any, strategy: str, references: dict[str, Any]) -> bool:
    """Per layer, a stacked bar of bytes by kind, with what the layer holds under the
    ``references`` (reports of no and full checkpointing) as marks; beside it, the whole
    model's bar with their totals as reference lines. False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = float(1 << 20)
    layers: list[str] = []
    for row in report.rows:
        name = row.layer or "outside layers"
        if name not in layers:
            layers.append(name)
    if "outside layers" in layers:  # embeddings, head and loss: last
        layers.remove("outside layers")
        layers.append("outside layers")
    kinds = [k for k in _COLOURS if any(r.kind == k for r in report.rows)]
    figure, (ax, total_ax) = plt.subplots(
        1,
        2,
        figsize=(max(6.0, 0.6 * len(layers) + 4), 4.5),
        width_ratios=[max(3, len(layers)), 1.4],
    )
    bottoms = [0.0] * len(layers)
    total_bottom = 0.0
    for kind in kinds:
        heights = [
            sum(
                r.bytes
                for r in report.rows
                if (r.layer or "outside layers") == name and r.kind == kind
            )
            / mib
            for name in layers
        ]
        ax.bar(range(len(layers)), heights, bottom=bottoms, color=_COLOURS[kind], label=kind)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
        total = sum(heights)
        total_ax.bar([0], [total], bottom=[total_bottom], color=_COLOURS[kind])
        total_bottom += total
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("held for backward (MiB)")
    ax.set_title(f"per layer, strategy {strategy}")
    styles = {"none": ("no checkpoint", "#d62728"), "full": ("full checkpoint", "#2ca02c")}
    for name, reference in references.items():
        label, colour = styles.get(name, (name, "black"))
        per_layer = reference.by_layer()
        heights = [per_layer.get(None if n == "outside layers" else n, 0) / mib for n in layers]
        ax.hlines(
            heights,
            [i - 0.45 for i in range(len(layers))],
            [i + 0.45 for i in range(len(layers))],
            colors=colour,
            linestyles="--",
            label=label,
        )
        nbytes = reference.total_bytes
        total_ax.axhline(
            nbytes / mib, color=colour, linestyle="--", label=f"{label}: {nbytes / mib:.1f}"
        )
    ax.legend(fontsize=7)
    total_ax.set_xticks([0])
    total_ax.set_xticklabels([f"{strategy}\n{report.total_bytes / mib:.1f} MiB"], fontsize=8)
    total_ax.set_title("whole model")
    top = max([total_bottom, *(r.total_bytes / mib for r in references.values())])
    total_ax.set_ylim(0, top * 1.15)
    total_ax.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
