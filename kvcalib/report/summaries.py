"""What each command prints for people: one summary per result, made of tables
(kvcalib.report.tables). JSON output is the result's to_dict(); these are its readable
form."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcalib.dtypes import E4M3_MAX
from kvcalib.report.tables import checks_table, result_line, right_aligned, table
from kvcalib.text import index_ranges, size, value_range

Render = Callable[[Sequence[str], Sequence[Sequence[Any]]], str]  # tables.table, markdown_table

if TYPE_CHECKING:  # the results summarized; each command imports only its own
    from kvcalib.bench.result import BenchResult, CacheRun
    from kvcalib.checkpoint.calibration_report import CalibrationReport
    from kvcalib.checkpoint.convert import Conversion
    from kvcalib.checkpoint.inspect import Inspection
    from kvcalib.evaluate.metrics import Metrics
    from kvcalib.evaluate.result import EvalResult
    from kvcalib.kvcache.capacity import Estimate
    from kvcalib.lmeval.result import LmEvalResult
    from kvcalib.verify.run import VerifyResult

# ----- run ----- #


def calibration_summary(report: CalibrationReport) -> str:
    kinds = [k for k in ("k", "v", "q") if getattr(report.layers[0], f"{k}_scale") is not None]
    headers = ["layer", *(f"{k}_scale" for k in kinds), *(f"{k} absmax" for k in kinds)]
    rows = [[layer.layer, *(value_range(getattr(layer, f"{k}_scale")) for k in kinds),
             *(f"{max(getattr(layer, f'{k}_absmax')):.4g}" for k in kinds)]
            for layer in report.layers]
    samples, timings = report.samples, report.timings_s
    footer = (f"{samples.used} samples x <= {samples.max_seq_len} tokens "
              f"({samples.num_tokens} tokens), strategy {report.scheme.strategy}, "
              f"observer {report.scheme.observer}, pipeline {report.pipeline.used}, "
              f"{report.compute.attention} attention; "
              f"load {timings['load']:.1f}s, calibrate {timings['calibrate']:.1f}s, "
              f"save {timings['save']:.1f}s")
    return table(headers, rows) + "\n" + footer


# ----- verify ----- #


def verify_summary(result: VerifyResult) -> str:
    return "\n".join([f"Checkpoint: {result.checkpoint}", checks_table(result.checks),
                      result_line(result.exit_code)])


# ----- eval ----- #


def eval_summary(result: EvalResult) -> str:
    """Metrics per configuration, passkey, sweep, KIVI, engine, then the gates."""
    s = result.samples
    lines = [f"Checkpoint: {result.checkpoint}",
             f"Held-out text: {s['source']}, {s['count']} samples ({s['tokens']:,} tokens, "
             f"<= {s['max_seq_len']} each), {s['excluded_calibration_rows']} calibration rows "
             f"excluded; {s['dtype']}, rounding {s['rounding']}; {s['seconds']}s",
             f"Reference perplexity: {result.reference_ppl:.4f}", ""]
    lines.append(table(METRICS_HEADERS, metrics_rows(result.metrics)))
    if result.verdict:
        lines.append(f"Verdict: {result.verdict}")
    if result.passkey:
        lines.append(passkey_line(result.passkey))
    if result.sweep:
        top = sorted(result.sweep["layers"], key=lambda e: -e["only_kl"])[:5]
        lines.append(f"Per-layer sensitivity (sweep samples: {result.sweep['samples']}; all layers "
                     f"KL {result.sweep['all_kl']:.5f}): alone, layers " + ", ".join(
                         f"{e['layer']} ({e['only_kl']:.5f})" for e in top))
        noise = result.sweep["within_noise"]
        if result.sweep.get("too_few_samples"):
            lines.append(f"What skipping a layer saves: {result.sweep['too_few_samples']} "
                         "samples (--sweep-samples and --num-samples), so no intervals and no "
                         "layer is recommended")
        else:
            lines.append(f"Skipping a layer saves KL within noise (95% interval includes 0) "
                         f"for {len(noise)} of {len(result.sweep['layers'])} layers"
                         + (f": {index_ranges(noise)}; these are never recommended"
                            if noise else ""))
        if "recommendation" in result.sweep:
            lines.append(skip_set_line(result.sweep["recommendation"]))
    if result.kivi and result.kivi.get("bytes_per_token"):
        b = result.kivi["bytes_per_token"]
        lines.append(f"KIVI 2-bit bytes per token at {b['tokens']} tokens: {b['kivi']:,.0f} "
                     f"(fp8 {b['fp8']:,.0f}, 16-bit {b['16bit']:,.0f}); long context: "
                     f"{b['kivi_long_context']:,.0f}")
    if result.formats:
        lines += ["", *formats_summary(result.formats, result.metrics)]
    if result.separate:
        lines += ["", *separate_summary(result.separate)]
    if result.engine and "separate" in result.engine:
        lines += ["", *engine_separate_summary(result.engine["separate"])]
    for note in result.notes:
        lines.append(f"Note: {note}")
    lines += ["", checks_table(result.checks), result_line(result.exit_code)]
    return "\n".join(lines)


METRICS_HEADERS = ["configuration", "mean KL", "95% interval", "p99 KL", "top-1", "PPL",
                   "PPL change", "clipped K", "clipped V", "clipped Q"]


def metrics_rows(metrics: dict[str, Metrics]) -> list[list[str]]:
    """One row per configuration, under METRICS_HEADERS (eval's table, and the model card's)."""
    rows = []
    for name, m in metrics.items():
        clipped = [f"{m.clipped[k]:.3%}" if k in m.clipped else "-" for k in ("k", "v", "q")]
        interval = f"{m.mean_kl_ci[0]:.5f}-{m.mean_kl_ci[1]:.5f}" if m.mean_kl_ci else "-"
        rows.append([name, f"{m.mean_kl:.5f}", interval, f"{m.p99_kl:.4f}", f"{m.top1:.2%}",
                     f"{m.ppl:.4f}", f"{m.ppl_change:+.2%}", *clipped])
    return rows


def passkey_line(passkey: dict[str, Any]) -> str:
    """'Passkey retrieval (6 trials of 1024..2048 tokens): reference 6/6, ...'."""
    trials = passkey["reference"]["trials"]
    lengths = sorted({t["length"] for t in trials})
    scores = ", ".join(f"{name} {sum(t['correct'] for t in r['trials'])}/{len(r['trials'])}"
                       for name, r in passkey.items())
    span = f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}..{lengths[-1]}"
    return f"Passkey retrieval ({len(trials)} trials of {span} tokens): {scores}"


def skip_set_line(rec: dict[str, Any]) -> str:
    """The sweep's recommendation: the layers to keep in the model dtype, and the KL then."""
    return (f"Skip set for mean KL <= {rec['max_kl']}: {rec['flag']} "
            f"(KL {rec['kl']:.5f}{'' if rec['met'] else ', budget not met'})")


def _interval(low: float, high: float, digits: str = ".4f") -> str:
    return f"[{low:{digits}}, {high:{digits}}]"


def _versus(difference: dict[str, Any] | None, digits: str = "+.4f") -> str:
    """'+0.0123 [+0.01, +0.02]', with 'noise' when the interval includes zero."""
    if difference is None:
        return "-"
    noise = " noise" if difference["within_noise"] else ""
    return (f"{difference['difference']:{digits}} "
            f"{_interval(difference['low'], difference['high'], digits)}{noise}")


def separate_summary(separate: dict[str, Any], render: Render = table) -> list[str]:
    """Weights only, KV only and both against the unquantized model, with the paired
    intervals of each row's KL and perplexity against it, then whether the errors add.
    Reads eval's result or its JSON; `render` makes the table (text, or Markdown)."""
    from kvcalib.evaluate.metrics import Metrics

    ref_ppl = separate["reference_ppl"]
    rows = []
    for name, row in separate["rows"].items():
        m, versus = row["metrics"], row["vs_reference"]
        m = m if isinstance(m, Metrics) else Metrics(**m)
        ppl = versus["ppl"] if versus else None
        change = "-" if ppl is None else (
            f"{_interval(ppl['low'] / ref_ppl, ppl['high'] / ref_ppl, '+.2%')}")
        rows.append([name, f"{m.mean_kl:.5f}",
                     _interval(*m.mean_kl_ci, ".5f") if m.mean_kl_ci else "-",
                     f"{m.top1:.2%}", f"{m.ppl:.4f}", f"{m.ppl_change:+.2%}", change])
    return [f"Weights and KV apart, against the unquantized model {separate['reference']} "
            f"(16-bit cache, perplexity {ref_ppl:.4f}); FP8 cache: {separate['fp8_cache']}",
            render(["configuration", "mean KL", "95% interval", "top-1", "PPL", "PPL change",
                    "95% interval"], rows),
            f"Combined vs separate: {separate['verdict']}"]


def engine_separate_summary(apart: dict[str, Any], render: Render = table) -> list[str]:
    """The same rows in vLLM: perplexity and its change with the paired interval, top-1
    agreement and mean |Δ log-prob| against the unquantized model's run."""
    if "error" in apart:
        return [f"In vLLM: {apart['error']}"]
    ref = apart["reference"]
    rows = []
    for name, row in apart["rows"].items():
        if "error" in row:
            rows.append([name, row["kv_cache_dtype"], "-", "-", "-", "-", "-", row["error"]])
            continue
        versus = row["vs_reference"]
        change = "-" if versus is None else _interval(versus["ppl"]["low"] / ref["ppl"],
                                                      versus["ppl"]["high"] / ref["ppl"], "+.2%")
        rows.append([name, row["kv_cache_dtype"], f"{row['ppl']:.4f}",
                     f"{row['ppl_change']:+.2%}", change, f"{row['top1_agreement']:.2%}",
                     f"{row['mean_abs_logprob_diff']:.4f}", ""])
    headers = ["configuration", "kv_cache_dtype", "PPL", "PPL change", "95% interval",
               "top-1 agreement", "mean |Δ log-prob|", "not run because"]
    if not any(row[-1] for row in rows):
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    lines = [f"In vLLM, against the unquantized model's run ({ref['kv_cache_dtype']} cache, "
             f"perplexity {ref['ppl']:.4f}), on the same token ids:", render(headers, rows)]
    if "interaction" in apart:
        lines.append(f"Combined minus the sum of the separate changes, mean NLL per token: "
                     f"{_versus(apart['interaction'])}")
    return lines


def formats_summary(formats: dict[str, Any], metrics: dict[str, Any]) -> list[str]:
    """The format comparison: one row per format (and static-scale choice), its capacity,
    its metrics and its difference from the reference with paired 95% intervals; then the
    recommendation and whether the two most accurate formats are told apart."""
    target = formats["target"]
    budget = formats["budget_bytes"]
    rows = []
    for row in formats["rows"]:
        m = metrics.get(row["metrics_key"] or "")
        versus = row["vs_reference"] or {}
        na = row["note"].startswith("n/a")
        runs = (row["runs_on"].get(target, "") if target else ", ".join(row["runs_on"]))
        gates = {True: "yes", False: "no", None: "-"}[row["meets_gates"]]
        if na:
            kl = ppl = "n/a"
        elif m is None:  # the model dtype: the reference itself
            kl, ppl = "0 (reference)", "+0.00%"
        else:
            kl = (f"{m.mean_kl:.4f} {_interval(*m.mean_kl_ci)}" if m.mean_kl_ci
                  else f"{m.mean_kl:.4f}")
            ppl = f"{m.ppl_change:+.2%}"
        rows.append([row["label"], "n/a" if na else f"{row['tokens_at_budget']:,}", kl,
                     _versus(versus.get("mean_kl")), ppl, _versus(versus.get("ppl"), "+.3f"),
                     "-" if row["passkey"] is None else f"{row['passkey']:.0%}", gates, runs])
    where = f" on {target}" if target else ""
    headers = ["format", f"tokens @ {budget / 2**30:g} GiB", "mean KL [95%]",
               f"KL vs {formats['reference']}", "PPL change", "PPL vs ref", "passkey",
               "gates", f"backend{where}" if target else "runs on"]
    lines = [f"KV cache formats{where} (blocks of {formats['block_size']} tokens; differences "
             f"are paired 95% intervals over the samples, 'noise' where they include 0):",
             table(headers, rows)]
    lines += [f"  {row['label']}: {row['note']}" for row in formats["rows"] if row["note"]]
    best = formats["recommendation"]
    gates = ", ".join(f"--{name.replace('_', '-')} {value}"
                      for name, value in formats["gates"].items() if value is not None)
    if not gates:
        lines.append("Recommendation: none; set --max-kl, --max-ppl-increase or --min-passkey "
                     "to choose the format with the most tokens that meets them")
    elif best is None or not best["quantized"]:
        lines.append(f"Recommendation{where}: no quantized format meets {gates}; keep "
                     "--kv-cache-dtype auto")
    else:
        lines.append(f"Recommendation{where}: {best['label']}, the most tokens at the budget "
                     f"({best['tokens_at_budget']:,}) among formats that meet {gates}: "
                     f"{best['flag']}")
    two = formats["top_two"]
    if two:
        interval = (f"difference {two['difference']:+.5f}, 95% interval "
                    f"{_interval(two['low'], two['high'], '+.5f')} over {two['samples']} samples")
        if two["within_noise"]:
            needed = two["samples_needed"]
            lines.append(f"Most accurate: {two['first']} vs {two['second']}: within noise "
                         f"({interval}); about {needed} samples would tell them apart")
        else:
            lines.append(f"Most accurate: {two['first']} beats {two['second']} ({interval}); "
                         f"about {two['samples_needed']} samples suffice to tell them apart")
    return lines


# ----- estimate ----- #


def _count(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def estimate_summary(result: Estimate) -> str:
    """The table and the facts it rests on, for people."""
    heads = (f"latent of {result.mla_latent_dim} dims (MLA, {result.num_heads} query heads)"
             if result.mla_latent_dim is not None else
             f"{result.num_kv_heads} KV heads x {result.head_dim} dims ({result.attention}, "
             f"{result.num_heads} query heads)")
    lines = [f"Model: {result.model} ({result.model_type}, {result.dtype})",
             f"KV cache: {len(result.attention_layers)} attention layers of "
             f"{result.num_layers}, {heads}",
             f"Requests: {result.batch} x {result.context_length:,} tokens "
             f"({result.context_source})"]
    if result.budget_bytes is not None:
        lines.append(f"Budget: {size(result.budget_bytes)} ({result.budget_bytes:,} bytes), "
                     f"blocks of {result.block_size} tokens")
    headers = ["format", "bytes/token", "per request", f"total (x{result.batch})"]
    rows = [[f.name, _count(f.bytes_per_token),
             size(f.request_bytes) if f.request_bytes is not None else "n/a",
             size(f.total_bytes) if f.total_bytes is not None else "n/a"]
            for f in result.formats]
    if result.budget_bytes is not None:
        headers += ["tokens that fit", f"max concurrency @ {result.context_length:,}"]
        for row, f in zip(rows, result.formats, strict=True):
            row += [_count(f.tokens_fit), _count(f.max_concurrency)]
    lines += ["", table(headers, right_aligned(headers, rows)), ""]
    lines += _estimate_notes(result)
    return "\n".join(lines)


def _estimate_notes(result: Estimate) -> list[str]:
    capped = ", sliding-window layers capped at their window" if result.sliding_layers else ""
    notes = [f"- bytes/token: every attention layer full; per request: "
             f"{result.context_length:,} tokens{capped}"]
    if result.budget_bytes is not None:
        notes.append(f"- tokens that fit: budget / bytes per token, in whole blocks of "
                     f"{result.block_size}; max concurrency: budget // per-request bytes")
    notes += [f"- {f.name}: {f.note}" for f in result.formats if f.note]
    windows: dict[int, list[int]] = {}
    for layer in result.sliding_layers:
        windows.setdefault(layer["window"], []).append(layer["index"])
    notes += [f"- sliding window {window:,}: layers {index_ranges(indices)}"
              for window, indices in windows.items()]
    kinds: dict[str, list[int]] = {}
    for layer in result.excluded_layers:
        kinds.setdefault(layer["block_type"], []).append(layer["index"])
    notes += [f"- not KV cache, not counted: {kind} layers {index_ranges(indices)}"
              for kind, indices in kinds.items()]
    if result.skip_layers:
        notes.append(f"- kept {result.dtype} in fp8/kivi2 (--kv-cache-dtype-skip-layers): "
                     f"layers {index_ranges(result.skip_layers)}")
    if result.defaults:
        notes.append("- absent from config.json, taken from transformers' defaults for "
                      f"{result.model_type}: {', '.join(result.defaults)}")
    return notes


# ----- inspect ----- #


def inspect_summary(result: Inspection, heads: bool = False) -> str:
    """A row per layer (scales as min..max over heads); with `heads`, a row per head too."""
    lines = [f"Checkpoint: {result.checkpoint}",
             f"Scheme: {result.layout}, strategy {result.strategy}, "
             f"{'/'.join(result.kinds)} scales on {len(result.layers)} attention layers",
             _calibration_line(result.calibration),
             "Median layer: " + ", ".join(
                 f"{k}_scale {m:.4g} (absmax {m * E4M3_MAX:.4g})"
                 for k, m in result.median.items()), ""]
    headers = ["layer"]
    for kind in result.kinds:
        headers += [f"{kind}_scale", f"{kind} absmax", f"{kind} x median"]
    rows = []
    for layer in result.layers:
        row: list[Any] = [layer.layer]
        for kind in result.kinds:
            scales = layer.kinds.get(kind)
            row += ([value_range(scales.scale), max(scales.absmax), round(max(scales.ratio), 2)]
                    if scales else ["-", "-", "-"])
        rows.append([*row, _flags(result.outliers, layer.layer)])
    lines.append(table([*headers, "flags"], rows))
    if heads and result.strategy == "attn_head":
        lines += ["", table(["layer", "kind", "head", "scale", "absmax", "x median",
                             "seen absmax"], _head_rows(result))]
    lines.append("")
    lines.append(f"Outliers (x median above {result.outlier_ratio:g} or below "
                 f"1/{result.outlier_ratio:g}) and clipping: "
                 f"{len(result.outliers) or 'none'}")
    lines += [f"Note: {note}" for note in result.notes]
    lines += [f"Problem: {problem}" for problem in result.problems]
    return "\n".join(lines)


def _flags(outliers: list[dict[str, Any]], layer: int) -> str:
    """One layer's outliers, heads of one kind and reason together: 'v x0.07..0.11 (heads
    0-2)', 'k clips (head 1)'."""
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for outlier in outliers:
        if outlier["layer"] == layer:
            clips = outlier["why"].startswith("clips")
            groups.setdefault((outlier["kind"], clips), []).append(outlier)
    flags = []
    for (kind, clips), items in groups.items():
        ratios = [item["ratio"] for item in items]
        what = "clips" if clips else "x" + value_range(ratios, ".2f")
        heads = [item["head"] for item in items if item["head"] is not None]
        which = f" (head{'s' if len(heads) > 1 else ''} {index_ranges(heads)})" if heads else ""
        flags.append(f"{kind} {what}{which}")
    return "; ".join(flags)


def _head_rows(result: Inspection) -> list[list[Any]]:
    rows = []
    for layer in result.layers:
        for kind, scales in layer.kinds.items():
            for head, scale in enumerate(scales.scale):
                seen = scales.seen_absmax[head] if scales.seen_absmax else None
                rows.append([layer.layer, kind, head, f"{scale:.4g}", f"{scales.absmax[head]:.4g}",
                             f"{scales.ratio[head]:.2f}", "-" if seen is None else f"{seen:.4g}"])
    return rows


def _calibration_line(calibration: dict[str, Any] | None) -> str:
    from kvcalib.checkpoint.calibration_report import REPORT_FILE

    if calibration is None:
        return f"Calibration: no {REPORT_FILE} in the checkpoint"
    dataset, samples = calibration.get("dataset", {}), calibration.get("samples", {})
    observer = calibration.get("scheme", {}).get("observer", "?")
    return (f"Calibration: {dataset.get('source', '?')}"
            f"{' ' + dataset['split'] if dataset.get('split') else ''}, "
            f"{samples.get('used', '?')} samples x <= {samples.get('max_seq_len', '?')} tokens "
            f"({samples.get('num_tokens', '?')} tokens), observer {observer}, "
            f"kvcalib {calibration.get('kvcalib_version', '?')} on "
            f"{calibration.get('created', '?')}")


# ----- convert ----- #


def convert_summary(result: Conversion) -> str:
    values = [max(v) for v in result.scales.values()]
    lines = [f"Converted {result.source} ({result.source_layout}) to {result.target_layout}: "
             f"{len(result.scales)} {result.strategy} scales "
             f"({value_range(values)})", f"Checkpoint: {result.output}"]
    return "\n".join(lines + [f"Note: {note}" for note in result.notes])


# ----- bench ----- #


def bench_summary(result: BenchResult) -> str:
    """One row per cache and concurrency: median over the repeats (range in brackets)."""
    lines = [f"Checkpoint: {result.checkpoint}", workload_line(result.workload)]
    lines += [f"{cache.label}: not measured: {cache.reason}"
              for cache in result.caches if not cache.ran]
    rows = bench_rows(result.caches)
    if rows:
        lines += ["", table(BENCH_HEADERS, right_aligned(BENCH_HEADERS, rows))]
    targets = {k: v for k, v in result.targets.items() if v is not None}
    if targets:
        said = ", ".join(f"{k.removeprefix('max_').replace('_ms', '')} p99 <= {v:g} ms"
                         for k, v in targets.items())
        lines += ["", f"Useful concurrency ({said}, worst repeat): " + ", ".join(
            f"{c.label} {c.useful_concurrency or 'none'}" for c in result.caches if c.ran)]
    lines += ["", checks_table(result.checks)]
    lines += ["", result_line(result.exit_code)]
    return "\n".join(lines)


def workload_line(work: dict[str, Any]) -> str:
    return (f"Workload: {work['num_prompts']} requests x ({work['input_len']} prompt + "
            f"{work['output_len']} output tokens), {work['repeats']} repeats, max_model_len "
            f"{work['max_model_len']}" + (f", KV budget {work['kv_budget']}"
                                          if work["kv_budget"] else ""))


BENCH_HEADERS = ["cache", "KV tokens", "concurrency", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms", "output tok/s", "req/s", "preempted"]


def bench_rows(caches: list[CacheRun]) -> list[list[str]]:
    """One row per measured cache and concurrency, under BENCH_HEADERS (bench's table, and
    the model card's)."""
    rows = []
    for cache in caches:
        if not cache.ran:
            continue
        tokens = _count(cache.capacity["tokens"]) if cache.capacity else "n/a"
        for row in cache.rows:
            rows.append([cache.label, tokens, str(row["concurrency"]),
                         *(_spread(row[key]) for key in (
                             "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
                             "output_throughput", "request_throughput", "preemptions"))])
    return rows


def _spread(values: dict[str, float]) -> str:
    median = values["median"]
    digits = ".0f" if abs(median) >= 100 or float(median).is_integer() else ".1f"
    if values["min"] == values["max"]:
        return f"{median:{digits}}"
    return f"{median:{digits}} [{values['min']:{digits}}-{values['max']:{digits}}]"



# ----- lm-eval ----- #


def lm_eval_summary(result: LmEvalResult) -> str:
    """Accuracy per task and length (95% bootstrap interval), per needle depth, the paired
    comparisons and the recovery verdict."""
    opts = result.options
    lines = [f"Checkpoint: {result.checkpoint}",
             f"Tasks: {', '.join(opts['tasks'])}; lengths {', '.join(map(str, opts['lengths']))};"
             f" {opts['limit']} examples per task and length"]
    lines += [f"{c.name}: not scored: {c.reason}" for c in result.configs if not c.ran]
    rows = [[r["config"], r["task"], str(r["length"] or "-"), str(r["n"]),
             _accuracy_cell(r)] for r in result.table()]
    if rows:
        headers = ["config", "task", "length", "n", "accuracy [95% CI]"]
        lines += ["", table(headers, right_aligned(headers, rows))]
    depth = result.depth_table()
    if depth:
        configs = list(dict.fromkeys(r["config"] for r in depth))
        cells = {(r["length"], r["depth"], r["config"]): r for r in depth}
        keys = sorted({(r["length"], r["depth"]) for r in depth},
                      key=lambda k: (k[0], int(k[1].split("-")[0])))
        headers = ["length", "needle depth", *configs]
        rows = [[str(length), bucket, *(
            f"{cells[length, bucket, c]['accuracy']:.0%} of {cells[length, bucket, c]['n']}"
            if (length, bucket, c) in cells else "-" for c in configs)]
            for length, bucket in keys]
        lines += ["", "By needle depth (RULER tasks together):",
                  table(headers, right_aligned(headers, rows))]
    comparisons = result.comparisons()
    if comparisons:
        headers = ["b vs a", "pairs", "only a right", "only b right", "McNemar p",
                   "accuracy b - a [95% CI]", "verdict"]
        rows = [[f"{c['b']} vs {c['a']}", str(c["n"]), str(c["only_a"]), str(c["only_b"]),
                 f"{c['p_value']:.3g}", _difference_cell(c), c["verdict"]]
                for c in comparisons]
        lines += ["", table(headers, right_aligned(headers, rows))]
    lines += ["", *result.verdict(), *result.notes, result_line(result.exit_code)]
    return "\n".join(line for line in lines if line is not None)


def _accuracy_cell(row: dict[str, Any]) -> str:
    if row["low"] is None:
        return f"{row['accuracy']:.1%} (too few to tell)"
    return f"{row['accuracy']:.1%} [{row['low']:.1%}, {row['high']:.1%}]"


def _difference_cell(row: dict[str, Any]) -> str:
    if row["difference"] is None:
        return "-"
    if row["low"] is None:
        return f"{row['difference']:+.1%}"
    return f"{row['difference']:+.1%} [{row['low']:+.1%}, {row['high']:+.1%}]"
