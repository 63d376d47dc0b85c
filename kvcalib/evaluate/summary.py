"""`kvcalib eval`'s summary: metrics per configuration, passkey, sweep, KIVI, formats, the
engine, then the gates; its tables are the model card's too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcalib.tables import Render, checks_table, result_line, table
from kvcalib.text import index_ranges

if TYPE_CHECKING:
    from kvcalib.evaluate.metrics import Metrics
    from kvcalib.evaluate.result import EvalResult


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
