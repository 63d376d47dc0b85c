"""Figures for kvcalib's commands: first one function per result (what to draw), then the
figure kinds (how). matplotlib is imported only when a figure is drawn, and only its
object API is used (no pyplot state), so library callers and tests can draw in parallel
without a display."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvcalib.calibrate.convergence import LATE_GROWTH, layer_curves
from kvcalib.errors import UsageError
from kvcalib.writes import atomic_output_file

if TYPE_CHECKING:  # the results drawn; each command imports only its own
    from kvcalib.bench.result import BenchResult
    from kvcalib.checkpoint.calibration_report import CalibrationReport
    from kvcalib.checkpoint.inspect import Inspection
    from kvcalib.evaluate.result import EvalResult
    from kvcalib.lmeval.result import LmEvalResult

# ----- what each result is drawn as ----- #


def convergence_plot(report: CalibrationReport, path: Path) -> Path:
    """`run --plot`: running absmax ÷ final against samples, every layer; flagged layers
    named."""
    named = {(f.kind, f.layer): f.last_half_growth for f in report.convergence.flagged}
    return convergence(path, layer_curves(report), named,
                       f"{Path(report.model.path).name}: running absmax / final, "
                       f"{report.samples.used} samples (flagged: grew > {LATE_GROWTH:.0%} in "
                       "the last half)")


def sensitivity_plot(result: EvalResult, path: Path) -> Path:
    """Per-layer sensitivity (from the sweep) above the checkpoint's scales per layer."""
    layers = result.layer_scales.get("layers", [])
    bars = {}
    if result.sweep:
        by_layer = {e["layer"]: e for e in result.sweep["layers"]}
        layers = layers or sorted(by_layer)
        bars = {"KL, only this layer FP8": [by_layer[i]["only_kl"] for i in layers],
                "KL saved by skipping it": [by_layer[i]["gain_if_skipped"] for i in layers]}
    lines = {f"{kind}_scale": [np.nan if v is None else v for v in result.layer_scales[kind]]
             for kind in ("k", "v") if any(v is not None for v in
                                           result.layer_scales.get(kind, []))}
    if not bars and not lines:
        raise UsageError("nothing to plot: no per-layer sweep (--sweep) and no scales")
    title = f"FP8 KV sensitivity: {Path(result.checkpoint).name}"
    if result.sweep and result.sweep.get("too_few_samples"):
        return sensitivity(path, layers, bars, lines, title, noise=layers,
                           noise_label=result.sweep["too_few_samples"] + " samples")
    return sensitivity(path, layers, bars, lines, title,
                       noise=result.sweep["within_noise"] if result.sweep else ())


def pareto_plot(result: EvalResult, path: Path) -> Path:
    """Tokens at the budget against mean KL for every format row that was scored."""
    if not result.formats:
        raise UsageError("nothing to plot: the Pareto plot needs --formats")
    points, reference = {}, None
    for row in result.formats["rows"]:
        m = result.metrics.get(row["metrics_key"] or "")
        if m is not None:
            low, high = m.mean_kl_ci or (m.mean_kl, m.mean_kl)
            points[row["label"]] = (row["tokens_at_budget"], m.mean_kl, low, high)
        elif not row["note"].startswith("n/a"):
            reference = (row["label"], row["tokens_at_budget"])
    target = result.formats["target"]
    if not points:
        raise UsageError(f"nothing to plot: no format of --formats was scored"
                         f"{' on ' + target if target else ''} (the table says why for each)")
    budget = result.formats["budget_bytes"] / 2**30
    return pareto(path, points, reference, f"tokens in a {budget:g} GiB KV cache",
                  f"KV formats{' on ' + target if target else ''}: "
                  f"{Path(result.checkpoint).name}")


def scales_plot(result: Inspection, path: Path) -> Path:
    """Scales by layer and head: a heatmap per kind for per-head scales, else lines."""
    indices = [layer.layer for layer in result.layers]
    title = f"{Path(result.checkpoint).name}: FP8 KV scales ({result.strategy})"
    if result.strategy == "attn_head":
        panels = {}
        for kind in result.kinds:
            width = max(len(layer.kinds[kind].scale) for layer in result.layers
                        if kind in layer.kinds)
            panels[f"{kind}_scale"] = np.array([
                layer.kinds[kind].scale if kind in layer.kinds else [np.nan] * width
                for layer in result.layers])
        return scales_heatmap(path, panels, indices, title)
    series = {f"{kind}_scale": [max(layer.kinds[kind].scale) if kind in layer.kinds else np.nan
                                for layer in result.layers] for kind in result.kinds}
    return scales_by_layer(path, series, indices, title)


# ----- figure kinds ----- #


def bench_plot(result: BenchResult, path: Path) -> Path:
    """`bench --plot`: output tokens/s and p99 TPOT against concurrency, a line per cache,
    the median with the range over repeats as error bars."""
    figure = _figure(10, 4)
    axes = figure.subplots(1, 2)
    for ax, key, label in ((axes[0], "output_throughput", "output tokens/s"),
                           (axes[1], "p99_tpot_ms", "p99 TPOT (ms)")):
        for cache in result.caches:
            if not cache.ran:
                continue
            x = [row["concurrency"] for row in cache.rows]
            mid = np.array([row[key]["median"] for row in cache.rows])
            low = mid - [row[key]["min"] for row in cache.rows]
            high = np.array([row[key]["max"] for row in cache.rows]) - mid
            tokens = f", {cache.capacity['tokens']:,} KV tokens" if cache.capacity else ""
            ax.errorbar(x, mid, yerr=[low, high], marker="o", capsize=3,
                        label=f"{cache.label}{tokens}")
        target = result.targets.get("max_tpot_ms")
        if key == "p99_tpot_ms" and target is not None:
            ax.axhline(target, color="grey", linestyle="--", label="target")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend()
    work = result.workload
    figure.suptitle(f"{Path(result.checkpoint).name}: {work['input_len']}+{work['output_len']}"
                    f" tokens, {work['num_prompts']} requests, {work['repeats']} repeats")
    return _save(figure, path)


def lm_eval_plot(result: LmEvalResult, path: Path) -> Path:
    """`lm-eval --plot`: accuracy against context length, a line per configuration and
    task, with the 95% bootstrap interval as error bars where there is one."""
    figure = _figure(7, 4.5)
    ax = figure.subplots()
    rows = [r for r in result.table() if r["length"] is not None]
    for config, task in dict.fromkeys((r["config"], r["task"]) for r in rows):
        mine = sorted((r for r in rows if (r["config"], r["task"]) == (config, task)),
                      key=lambda r: r["length"])
        mid = np.array([r["accuracy"] for r in mine])
        low = np.array([r["low"] if r["low"] is not None else r["accuracy"] for r in mine])
        high = np.array([r["high"] if r["high"] is not None else r["accuracy"] for r in mine])
        ax.errorbar([r["length"] for r in mine], mid, yerr=[mid - low, high - mid],
                    marker="o", capsize=3, label=f"{config}, {task}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize="small")
    ax.set_title(f"{Path(result.checkpoint).name}: lm-eval, {result.options['limit']} "
                 "examples per task and length")
    return _save(figure, path)


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(figure, path: Path) -> Path:
    """Write the figure whole at `path`, in the format its extension names (PNG without)."""
    path = Path(path)
    with atomic_output_file(path) as tmp:
        figure.savefig(tmp, dpi=120, format=path.suffix[1:] or "png")
    return path


def scales_heatmap(path: Path, panels: Mapping[str, np.ndarray], layers: Sequence[int],
                   title: str, colorbar: str = "scale") -> Path:
    """One heatmap per panel, side by side: rows are layers, columns heads (NaN: missing)."""
    widths = [max(matrix.shape[1], 2) for matrix in panels.values()]
    figure = _figure(2.5 + 0.35 * sum(widths) + 1.2 * len(panels),
                     max(4.0, 1.5 + 0.2 * len(layers)))
    axes = figure.subplots(1, len(panels), squeeze=False,
                           gridspec_kw={"width_ratios": widths})[0]
    step = max(1, len(layers) // 30)  # at most ~30 layer labels
    for ax, (name, matrix) in zip(axes, panels.items(), strict=True):
        image = ax.imshow(np.asarray(matrix, dtype=float), aspect="auto", cmap="viridis",
                          interpolation="nearest")
        ax.set_title(name)
        ax.set_xlabel("head")
        ax.set_xticks(range(matrix.shape[1]))
        ax.set_yticks(range(0, len(layers), step), [str(i) for i in layers[::step]])
        figure.colorbar(image, ax=ax, label=colorbar)
    axes[0].set_ylabel("layer")
    figure.suptitle(title)
    return _save(figure, path)


def scales_by_layer(path: Path, series: Mapping[str, Sequence[float]], layers: Sequence[int],
                    title: str, ylabel: str = "scale", log: bool = True) -> Path:
    """One line per series over the layers (log y by default: kinds differ by orders of
    magnitude, and outliers are ratios)."""
    figure = _figure(max(6.0, 0.2 * len(layers) + 2), 4.0)
    ax = figure.subplots()
    for name, values in series.items():
        ax.plot(layers, values, marker="o", markersize=3, label=name)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title)
    return _save(figure, path)


def sensitivity(path: Path, layers: Sequence[int], bars: Mapping[str, Sequence[float]],
                lines: Mapping[str, Sequence[float]], title: str,
                noise: Collection[int] = (),
                noise_label: str = "within noise (95% interval includes 0)") -> Path:
    """Per-layer bars (KL when one layer is quantized, or gained when it is skipped) above
    per-layer lines (scales), sharing the layer axis. Either part may be empty. Layers in
    `noise` (their effect cannot be told from zero, `noise_label` says why) get hatched,
    faint bars."""
    parts = [part for part in (bars, lines) if part]
    figure = _figure(max(7.0, 0.25 * len(layers) + 2), 3.2 * len(parts))
    axes = figure.subplots(len(parts), 1, sharex=True, squeeze=False)[:, 0]
    ax = iter(axes)
    if bars:
        top = next(ax)
        width = 0.8 / len(bars)
        faint = [layer in noise for layer in layers]
        for i, (name, values) in enumerate(bars.items()):
            drawn = top.bar(np.asarray(layers) + (i - (len(bars) - 1) / 2) * width, values,
                            width, label=name)
            for bar, within in zip(drawn, faint, strict=True):
                if within:
                    bar.set_alpha(0.35)
                    bar.set_hatch("//")
        if any(faint):
            top.bar([], [], color="0.6", alpha=0.35, hatch="//", label=noise_label)
        top.set_ylabel("mean KL")
        top.legend()
        top.grid(True, axis="y", alpha=0.3)
    if lines:
        bottom = next(ax)
        for name, values in lines.items():
            bottom.plot(layers, values, marker="o", markersize=3, label=name)
        bottom.set_yscale("log")
        bottom.set_ylabel("scale (largest head)")
        bottom.legend()
        bottom.grid(True, alpha=0.3)
    axes[-1].set_xlabel("layer")
    figure.suptitle(title)
    return _save(figure, path)


def convergence(path: Path, curves: Mapping[str, Mapping[int, np.ndarray]],
                named: Mapping[tuple[str, int], float], title: str) -> Path:
    """One panel per kind: each layer's running absmax ÷ final against samples. Layers in
    `named` ((kind, layer) -> growth in the last half) are drawn in colour and labelled;
    the others in grey."""
    figure = _figure(7.0, 2.8 * len(curves) + 0.6)
    axes = figure.subplots(len(curves), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (kind, layers) in zip(axes, curves.items(), strict=True):
        for layer, ratio in layers.items():
            samples = np.arange(1, len(ratio) + 1)
            if (kind, layer) in named:
                ax.step(samples, ratio, where="post", linewidth=1.6,
                        label=f"layer {layer} (+{named[kind, layer]:.1%} in the last half)")
            else:
                ax.step(samples, ratio, where="post", color="0.75", linewidth=0.8)
        ax.set_ylabel(f"{kind}: running / final")
        ax.grid(True, alpha=0.3)
        flagged = sum(key[0] == kind for key in named)
        if flagged:
            ax.legend(fontsize="small", ncol=1 + flagged // 12)  # 80 layers may all be named
        half = len(next(iter(layers.values()))) // 2  # growth is measured from here
        ax.axvline(half, color="0.5", linestyle=":", linewidth=0.8)
    axes[-1].set_xlabel("samples")
    figure.suptitle(title, fontsize="medium")
    return _save(figure, path)


def pareto(path: Path, points: Mapping[str, tuple[float, float, float, float]],
           reference: tuple[str, float] | None, xlabel: str, title: str) -> Path:
    """Tokens at a budget (x) against mean KL (y, log) per format: label -> (tokens, KL,
    interval low, interval high). The formats no other beats on both axes are joined (the
    Pareto front); the unquantized reference (label, tokens) is a vertical line."""
    figure = _figure(8.0, 5.0)
    ax = figure.subplots()
    names = list(points)
    x, y, low, high = (np.array([points[n][i] for n in names], dtype=float) for i in range(4))
    ax.errorbar(x, y, yerr=[y - low, high - y], fmt="o", capsize=3, color="tab:blue")
    for i, name in enumerate(names):  # labels of points at one capacity stacked upward
        stacked = sum(x[j] == x[i] and (y[j], j) < (y[i], i) for j in range(len(names)))
        ax.annotate(name, (x[i], y[i]), textcoords="offset points",
                    xytext=(6, -4 + 10 * stacked), fontsize="small")
    front = [i for i in range(len(names)) if not any(
        x[j] >= x[i] and y[j] <= y[i] and (x[j], y[j]) != (x[i], y[i]) for j in range(len(names)))]
    front.sort(key=lambda i: x[i])
    ax.plot(x[front], y[front], color="tab:orange", linewidth=1.2, label="Pareto front")
    if reference:
        ax.axvline(reference[1], color="0.5", linestyle=":", label=f"{reference[0]} (KL 0)")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean KL vs the exact model (95% interval)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(title)
    return _save(figure, path)
