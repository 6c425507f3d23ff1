"""The pictures of the commands (matplotlib, imported when drawing; no framework imports):
``recomp bench --plot`` (memory against step time, replay FLOPs) and ``recomp report
--png`` (what each layer holds for backward, by kind)."""

from __future__ import annotations

import os
from typing import Any

from .results import Result

MiB = float(1 << 20)


def write_plot(path: str, results: list[Result]) -> None:
    """Memory vs step time per strategy (one panel per framework) and replay FLOPs bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    frameworks = [f for f in ("torch", "mindspore") if any(r.framework == f for r in ok)]
    flops = [r for r in ok if r.replay_flops is not None]
    panels = len(frameworks) + (1 if flops else 0)
    fig, axes = plt.subplots(1, max(1, panels), figsize=(5.5 * max(1, panels), 4.5))
    axes = list(axes) if panels > 1 else [axes]
    for ax, fw in zip(axes, frameworks):
        rows = [
            r
            for r in ok
            if r.framework == fw and r.step_time_s is not None and r.activation_bytes is not None
        ]
        for i, r in enumerate(rows):
            x, y = (r.step_time_s or 0.0) * 1e3, (r.activation_bytes or 0) / MiB
            xerr = (r.step_time_spread_s or 0.0) * 1e3 / 2
            planned = r.strategy.startswith("plan@")
            ax.errorbar(
                x, y, xerr=xerr, fmt="*" if planned else "o", capsize=3, ms=10 if planned else 6
            )
            if planned and r.plan is not None:
                ax.axhline(r.plan.budget_bytes / MiB, ls=":", lw=0.8, color="gray")
            # Staggered labels: strategies with equal memory sit side by side; plans are
            # labelled below their point, the others above.
            ax.annotate(
                r.strategy,
                (x, y),
                textcoords="offset points",
                xytext=(4, -14 - 9 * (i % 2)) if planned else (4, 6 + 11 * (i % 3)),
                fontsize=8,
                arrowprops={"arrowstyle": "-", "lw": 0.5, "alpha": 0.5},
            )
        ax.margins(x=0.1, y=0.18)
        ax.set_xlabel("step time, median (ms)")
        ax.set_ylabel("activation memory after forward (MiB)")
        ax.set_title(f"{fw}: memory vs step time")
        ax.grid(alpha=0.3)
    if flops:
        ax = axes[-1]
        single = len({r.framework for r in flops}) == 1
        labels = [r.strategy if single else f"{r.framework}:{r.strategy}" for r in flops]
        ax.bar(labels, [(r.replay_flops or 0) / 1e9 for r in flops], color="tab:orange")
        ax.set_ylabel("replay FLOPs per step (GFLOP)")
        ax.set_title("work repeated in the replay" + (f" ({flops[0].framework})" if single else ""))
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def write_report_png(path: str, report: Any, strategy: str, references: dict[str, Any]) -> bool:
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
