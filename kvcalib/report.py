"""Rendering results for people (aligned tables) and for pipelines (JSON, JUnit XML)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def index_ranges(indices: list[int]) -> str:
    """'0-3, 7, 9-12': layer lists stay short in messages and tables."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def scale_range(values: Sequence[float]) -> str:
    """One scale, or min..max over heads."""
    lo, hi = min(values), max(values)
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}..{hi:.4g}"


def calibration_summary(report: dict[str, Any]) -> str:
    kinds = [k for k in ("k", "v", "q") if f"{k}_scale" in report["layers"][0]]
    headers = ["layer", *(f"{k}_scale" for k in kinds), *(f"{k} absmax" for k in kinds)]
    rows = [[layer["layer"], *(scale_range(layer[f"{k}_scale"]) for k in kinds),
             *(f"{max(layer[f'{k}_absmax']):.4g}" for k in kinds)]
            for layer in report["layers"]]
    samples, timings = report["samples"], report["timings_s"]
    footer = (f"{samples['used']} samples x <= {samples['max_seq_len']} tokens "
              f"({samples['num_tokens']} tokens), strategy {report['scheme']['strategy']}, "
              f"observer {report['scheme']['observer']}, pipeline {report['pipeline']['used']}, "
              f"{report['compute']['attention']} attention; "
              f"load {timings['load']:.1f}s, calibrate {timings['calibrate']:.1f}s, "
              f"save {timings['save']:.1f}s")
    return table(headers, rows) + "\n" + footer


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=1) + "\n")


def write_text(path: Path, text: str) -> None:
    """Replace `path` whole (missing folders are created): a reader never sees half a file."""
    from kvcalib.checkpoint import atomic_output_file

    with atomic_output_file(path) as tmp:
        tmp.write_text(text)


_STATUS_ORDER = ["fail", "error", "warn", "pass", "skip"]
_SHOWN_PER_GROUP = 6


def checks_table(checks) -> str:
    """One line per check group; failures listed one by one (at most a few per group)."""
    rows = []
    groups: dict[str, list] = {}
    for check in checks:
        groups.setdefault(check.group, []).append(check)
    for group, members in groups.items():
        worst = min((c.status for c in members), key=_STATUS_ORDER.index)
        shown = [c for c in members if c.status == worst]
        if worst in ("pass", "skip") and len(shown) > 1:
            verb = "passed" if worst == "pass" else "skipped"
            rows.append([group, worst, f"{len(shown)} checks {verb}, e.g. {shown[0].message}"])
            continue
        for check in shown[:_SHOWN_PER_GROUP]:
            first, *more = check.message.splitlines() or [""]
            rows.append([group, check.status, first])
            rows += [["", "", f"  {line}"] for line in more]  # e.g. an error's reasons
        if len(shown) > _SHOWN_PER_GROUP:
            rows.append([group, worst, f"... and {len(shown) - _SHOWN_PER_GROUP} more"])
    return table(["check", "status", "detail"], rows)


def _result_line(code: int) -> str:
    verdict = {0: "PASS", 1: "FAIL", 2: "ERROR (could not verify)"}[code]
    return f"Result: {verdict} (exit code {code})"


def verify_summary(result) -> str:
    return "\n".join([f"Checkpoint: {result.checkpoint}", checks_table(result.checks),
                      _result_line(result.exit_code)])


def eval_summary(result) -> str:
    """Metrics per configuration, passkey, sweep, KIVI, engine, then the gates."""
    s = result.samples
    lines = [f"Checkpoint: {result.checkpoint}",
             f"Held-out text: {s['source']}, {s['count']} samples ({s['tokens']:,} tokens, "
             f"<= {s['max_seq_len']} each), {s['excluded_calibration_rows']} calibration rows "
             f"excluded; {s['dtype']}, rounding {s['rounding']}; {s['seconds']}s",
             f"Reference perplexity: {result.reference_ppl:.4f}", ""]
    rows = []
    for name, m in result.metrics.items():
        clipped = [f"{m.clipped[k]:.3%}" if k in m.clipped else "-" for k in ("k", "v", "q")]
        interval = f"{m.mean_kl_ci[0]:.5f}-{m.mean_kl_ci[1]:.5f}" if m.mean_kl_ci else "-"
        rows.append([name, f"{m.mean_kl:.5f}", interval, f"{m.p99_kl:.4f}", f"{m.top1:.2%}",
                     f"{m.ppl:.4f}", f"{m.ppl_change:+.2%}", *clipped])
    lines.append(table(["configuration", "mean KL", "95% interval", "p99 KL", "top-1", "PPL",
                        "PPL change", "clipped K", "clipped V", "clipped Q"], rows))
    if result.verdict:
        lines.append(f"Verdict: {result.verdict}")
    if result.passkey:
        trials = result.passkey["reference"]["trials"]
        lengths = sorted({t["length"] for t in trials})
        scores = ", ".join(f"{name} {sum(t['correct'] for t in r['trials'])}/{len(r['trials'])}"
                           for name, r in result.passkey.items())
        span = f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}..{lengths[-1]}"
        lines.append(f"Passkey retrieval ({len(trials)} trials of {span} tokens): {scores}")
    if result.sweep:
        top = sorted(result.sweep["layers"], key=lambda e: -e["only_kl"])[:5]
        lines.append(f"Per-layer sensitivity (sweep samples: {result.sweep['samples']}; all layers "
                     f"KL {result.sweep['all_kl']:.5f}): alone, layers " + ", ".join(
                         f"{e['layer']} ({e['only_kl']:.5f})" for e in top))
        noise = result.sweep["within_noise"]
        lines.append(f"Skipping a layer saves KL within noise (95% interval includes 0) for "
                     f"{len(noise)} of {len(result.sweep['layers'])} layers"
                     + (f": {index_ranges(noise)}; these are never recommended" if noise else ""))
        if "recommendation" in result.sweep:
            rec = result.sweep["recommendation"]
            lines.append(f"Skip set for mean KL <= {rec['max_kl']}: {rec['flag']} "
                         f"(KL {rec['kl']:.5f}{'' if rec['met'] else ', budget not met'})")
    if result.kivi and result.kivi.get("bytes_per_token"):
        b = result.kivi["bytes_per_token"]
        lines.append(f"KIVI 2-bit bytes per token at {b['tokens']} tokens: {b['kivi']:,.0f} "
                     f"(fp8 {b['fp8']:,.0f}, 16-bit {b['16bit']:,.0f}); long context: "
                     f"{b['kivi_long_context']:,.0f}")
    if result.formats:
        lines += ["", *formats_summary(result.formats, result.metrics)]
    for note in result.notes:
        lines.append(f"Note: {note}")
    lines += ["", checks_table(result.checks), _result_line(result.exit_code)]
    return "\n".join(lines)


def _interval(low: float, high: float, digits: str = ".4f") -> str:
    return f"[{low:{digits}}, {high:{digits}}]"


def _versus(difference: dict[str, Any] | None, digits: str = "+.4f") -> str:
    """'+0.0123 [+0.01, +0.02]', with 'noise' when the interval includes zero."""
    if difference is None:
        return "-"
    noise = " noise" if difference["within_noise"] else ""
    return (f"{difference['difference']:{digits}} "
            f"{_interval(difference['low'], difference['high'], digits)}{noise}")


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


def junit_xml(suite: str, checks) -> str:
    """JUnit XML for CI systems: one test case per check."""
    import xml.etree.ElementTree as ET

    counts = {s: sum(c.status == s for c in checks) for s in _STATUS_ORDER}
    root = ET.Element("testsuite", name=suite, tests=str(len(checks)),
                      failures=str(counts["fail"]), errors=str(counts["error"]),
                      skipped=str(counts["skip"]))
    for index, check in enumerate(checks):
        name = f"{check.group}[{index}]" + (f" layer {check.layer}" if check.layer is not None
                                            else "")
        case = ET.SubElement(root, "testcase", classname=f"{suite}.{check.group}", name=name)
        tag = {"fail": "failure", "error": "error", "skip": "skipped"}.get(check.status)
        if tag:
            ET.SubElement(case, tag, message=check.message)
        else:
            ET.SubElement(case, "system-out").text = check.message
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
