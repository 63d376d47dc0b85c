"""The model card a release publishes: the checkpoint's README.md, written (or updated) by
`kvcalib card` from its calibration report and the JSON results of `eval`, `bench` and an
lm-eval run.

What the card holds: Hugging Face front matter (base_model, base_model_relation: quantized,
library_name: vllm, tags), made and merged by huggingface_hub's ModelCardData; the serving
command; the calibration's provenance from kvcalib_report.json; and each measured table
with the command line that produced it (every kvcalib command's JSON records it under
"command").

Updating: the generated part sits between BEGIN and END. Text outside them is kept byte
for byte, the user's front matter keys are kept (ours are set), a README without the
markers gets the part appended, and a second run with the same inputs gives the same bytes.

Result JSON, by option (each may carry "command", the command line that produced it),
read back as the result type that wrote it (CommandResult.from_dict):
- --eval: `kvcalib eval --json`, an EvalResult (samples, reference_ppl, metrics, checks...);
- --bench: `kvcalib bench --json`, a BenchResult (workload, caches, ...);
- --lm-eval: `kvcalib lm-eval --json`, an LmEvalResult (configs and samples, from which its
  tables, comparisons and verdict are computed again);
- any result whose shape is not the one expected, rendered generically, the
  first that fits: "summary_markdown" (Markdown, kept as it is); "rows", a list of objects
  (a table, one column per key); lm-evaluation-harness's own "results" ({task: {"metric,
  filter": value, "metric_stderr,filter": stderr}}); else the top-level numbers and strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvcalib.bench.result import BenchResult
from kvcalib.bench.summary import BENCH_HEADERS, bench_rows, workload_line
from kvcalib.checkpoint.calibration_report import REPORT_FILE, CalibrationReport
from kvcalib.checks import CommandResult
from kvcalib.engine.targets import Outcome, Verdict, fix_hint
from kvcalib.errors import UsageError
from kvcalib.evaluate.result import EvalResult
from kvcalib.evaluate.summary import (
    METRICS_HEADERS,
    engine_separate_summary,
    metrics_rows,
    passkey_line,
    separate_summary,
    skip_set_line,
)
from kvcalib.hub import HUB_ID
from kvcalib.lmeval.result import LmEvalResult
from kvcalib.reads import read_json
from kvcalib.tables import markdown_table
from kvcalib.text import value_range

Typed = TypeVar("Typed", bound=CommandResult)
BEGIN, END = "<!-- kvcalib:begin -->", "<!-- kvcalib:end -->"
TAGS = ["kvcalib", "fp8", "kv-cache", "compressed-tensors"]
SERVE = "vllm serve {name} --kv-cache-dtype fp8"


@dataclass(frozen=True)
class Results:
    """The measured results to show, each a parsed JSON object (None: not given)."""

    eval: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    lm_eval: dict[str, Any] | None = None


@dataclass
class Card:
    text: str
    notes: list[str] = field(default_factory=list)  # for the user, not the card


def load_result(path: Path, option: str) -> dict[str, Any]:
    """A result JSON file: a bounded read, and a JSON object, or a clear usage error."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UsageError(f"{option} {path}: no such file")
    data = read_json(path.parent, path.name, what="result JSON")
    if not isinstance(data, dict):
        raise UsageError(f"{option} {path} is not a result: top level is not a JSON object")
    return data


def measured_elsewhere(results: Results, checkpoint: Path) -> list[str]:
    """Notes for results whose "checkpoint" is another folder than the card's (a card
    should show what was measured on its own checkpoint; the user decides)."""
    here = Path(checkpoint).resolve()
    notes = []
    for option, data in (("--eval", results.eval), ("--bench", results.bench),
                         ("--lm-eval", results.lm_eval)):
        measured = (data or {}).get("checkpoint")
        if isinstance(measured, str) and Path(measured).expanduser().resolve() != here:
            notes.append(f"{option} measured {measured}, not {checkpoint}")
    return notes


def default_base_model(report: CalibrationReport) -> str | None:
    """The input model's hub id when `run` downloaded it from the Hub (a local folder
    names no base model)."""
    source, path = report.model.source, report.model.path
    if HUB_ID.match(source) and f"models--{source.replace('/', '--')}" in path:
        return source
    return None


def render_card(report: CalibrationReport, existing: str, name: str,
                base_model: str | None, results: Results,
                serving: Sequence[Verdict] = ()) -> Card:
    """The README's new text: `existing` (may be empty) with our front matter keys set and
    the generated part put between the markers; `serving`: where it serves (every target)."""
    notes = []
    metadata: dict[str, Any] = {"library_name": "vllm"}
    if base_model:
        metadata.update(base_model=base_model, base_model_relation="quantized")
    else:
        notes.append(f"no --base-model, and the input model {report.model.source} is not a "
                     "hub id: the front matter keeps the base_model it had (a new card has "
                     "none); pass --base-model ORG/NAME")
    block = "\n".join([BEGIN, *_body(report, name, base_model, results, notes),
                       *_where_it_serves(serving), END])
    return Card(_merge(existing, block, metadata), notes)


def _merge(existing: str, block: str, metadata: dict[str, Any]) -> str:
    """Set our front matter keys (tags: the user's, then ours) and put `block` in place."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    if REGEX_YAML_BLOCK.search(existing):
        try:
            card = ModelCard(existing)
        except Exception as exc:  # yaml's errors, or metadata that is not a mapping
            raise UsageError(f"the README's front matter cannot be read: {exc}") from None
        data, body = card.data, card.text
    else:
        card, data, body = None, ModelCardData(), existing
    user_tags = data.tags if isinstance(data.tags, list) else [data.tags] if data.tags else []
    for key, value in metadata.items():
        data[key] = value
    data.tags = [*user_tags, *(tag for tag in TAGS if tag not in user_tags)]
    body = _put_block(body, block)
    if card is None:
        return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
    card.text = body
    return str(card)


def _put_block(body: str, block: str) -> str:
    """`body` with its marked part replaced by `block`, or `block` appended."""
    begins, ends = body.count(BEGIN), body.count(END)
    if begins == ends == 0:
        separator = "\n" if not body or body.endswith("\n") else "\n\n"
        return body + separator + block + "\n"
    if begins != 1 or ends != 1 or body.index(BEGIN) > body.index(END):
        raise UsageError(f"the README has {begins} {BEGIN} and {ends} {END} marker(s); "
                         "kvcalib updates exactly one begin ... end pair: fix the markers "
                         "(or remove both to append a new part)")
    return body[:body.index(BEGIN)] + block + body[body.index(END) + len(END):]


# ----- the generated part ----- #


def _body(report: CalibrationReport, name: str, base_model: str | None, results: Results,
          notes: list[str]) -> list[str]:
    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else (
        f"`{report.model.source}`")
    quantized = report.weight_quantization
    weights = ("the input model's weights, unchanged" if quantized is None else
               f"the input model's quantized weights ({quantized.format}), unchanged"
               if quantized.quantized_by == "input" else
               f"weights quantized in the same pass ({quantized.preset})")
    lines = [f"# {name}", "",
             f"{base} with calibrated FP8 (E4M3) KV-cache scales: one k_scale and v_scale per "
             f"{'KV head' if report.scheme.strategy == 'attn_head' else 'attention layer'}, "
             f"which vLLM loads when it stores the KV cache in FP8; {weights}. "
             f"Calibrated with kvcalib {report.kvcalib_version}.", "",
             *_serving(name, results.eval, notes), "", *_provenance(report)]
    for title, data, render in (("Accuracy (`kvcalib eval`)", results.eval, _eval),
                                ("Serving (`kvcalib bench`)", results.bench, _bench),
                                ("Long-context quality (lm-eval)", results.lm_eval, _lm_eval)):
        if data is not None:
            lines += ["", f"## {title}", "", *render(data), "", _command(data)]
    return lines


def _serving(name: str, evaluation: dict[str, Any] | None, notes: list[str]) -> list[str]:
    """The vLLM command, with the layers `eval --sweep --max-kl` recommends keeping in the
    model dtype (none otherwise: no advice is made up)."""
    command = SERVE.format(name=name)
    said = []
    rec = ((evaluation or {}).get("sweep") or {}).get("recommendation")
    if rec and rec.get("skip_layers"):
        command += " --kv-cache-dtype-skip-layers " + " ".join(map(str, rec["skip_layers"]))
        said += [f"The skip layers keep those layers' cache in the model dtype: "
                 f"`kvcalib eval --sweep` found them the most sensitive "
                 f"({skip_set_line(rec)}).", ""]
    elif rec is None and evaluation is not None:
        notes.append("the eval JSON has no skip-layer recommendation (eval --sweep --max-kl); "
                     "the serving command keeps every layer in FP8")
    return ["## Serving", "", "```bash", command, "```", "", *said,
            "vLLM reads the scales from the checkpoint. Its config declares the FP8 KV "
            "scheme, so vLLM 0.32 stores the cache in FP8 even with the default "
            "`--kv-cache-dtype auto`; `fp8` says so explicitly, and `--kv-cache-dtype "
            "bfloat16` keeps the cache in the model dtype (the scales unused). On CPU, an FP8 "
            "cache needs x86 with AVX-512 or AMX."]


def _where_it_serves(verdicts: Sequence[Verdict]) -> list[str]:
    """What each engine and GPU does with these scales (docs/targets.md has the rules)."""
    if not verdicts:
        return []
    rows = [[v.target, v.engine, v.hardware, f"**{v.outcome}**",
             "" if v.outcome == Outcome.SERVES else f"{v.says} ({v.source})"]
            for v in verdicts]
    hint = fix_hint(verdicts)
    return ["", "## Where it serves", "",
            "What each engine does with these scales, from its own source at the pinned "
            "version (`kvcalib verify --target all` gives the same verdict):", "",
            markdown_table(["target", "engine", "hardware", "outcome", "why"], rows),
            *(["", hint] if hint else [])]


def _provenance(report: CalibrationReport) -> list[str]:
    """Where the scales came from: data, samples, method, software."""
    d, s, scheme = report.dataset, report.samples, report.scheme
    where = " ".join(part for part in (d.source, d.config, d.split) if part)
    rows = [
        ["input model", f"{report.model.source} ({report.model.architecture})"],
        ["dataset", f"{where}, column `{d.text_column}`: {len(set(d.rows_used))} of "
                    f"{d.num_rows:,} rows (seed {d.seed})"],
        ["token ids sha256", f"`{d.token_ids_sha256}`"],
        ["samples", f"{s.used} × ≤ {s.max_seq_len} tokens ({s.num_tokens:,} tokens)"],
        ["scheme", f"{scheme.num_bits}-bit {scheme.type} ({scheme.format}), strategy "
                   f"{scheme.strategy}" + (", with q_scale" if scheme.q_scale else "")],
        ["observer", scheme.observer],
        ["pipeline", f"{report.pipeline.used} ({report.pipeline.reason})"],
        ["compute", f"{report.compute.device}, {report.compute.dtype}, "
                    f"{report.compute.attention} attention; saved as "
                    f"{report.compute.checkpoint_dtype}"],
        ["scales", _scale_ranges(report)],
    ]
    if report.distributed is not None and report.distributed.world_size > 1:
        rows.append(["ranks", str(report.distributed.world_size)])
    if report.convergence is not None:
        flagged, grew = len(report.convergence.flagged), report.convergence.late_growth_threshold
        rows.append(["convergence", f"{flagged} layer scale(s) grew by more than {grew:.0%} in "
                     "the last half of the samples (more samples may raise them)" if flagged
                     else f"no scale grew by more than {grew:.0%} in the last half of the "
                     "samples"])
    rows += [["kvcalib", f"{report.kvcalib_version}, {report.created}"],
             ["versions", ", ".join(f"{k} {v}" for k, v in sorted(report.versions.items()))]]
    return ["## Calibration", "", f"From `{REPORT_FILE}`, which holds every scale and the "
            "absmax behind it.", "", markdown_table(["field", "value"], rows)]


def _scale_ranges(report: CalibrationReport) -> str:
    kinds = [k for k in ("k", "v", "q") if getattr(report.layers[0], f"{k}_scale") is not None]
    ranges = [f"{k}_scale " + value_range([x for layer in report.layers
                                           for x in getattr(layer, f"{k}_scale")])
              for k in kinds]
    return "; ".join(ranges) + f" over {len(report.layers)} attention layers"


def _command(data: dict[str, Any]) -> str:
    command = data.get("command")
    if isinstance(command, str):
        return f"Produced by: `{command}`"
    return "Produced by: (not recorded: this JSON predates kvcalib's \"command\" field)"


def _read_back(kind: type[Typed], data: dict[str, Any], option: str, command: str) -> Typed:
    """`data` as the result type that wrote it, or a usage error naming the option."""
    try:
        return kind.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        first = str(exc).splitlines()[0]
        raise UsageError(f"{option}: not a `{command}` result ({type(exc).__name__}: "
                         f"{first})") from None


def _eval(data: dict[str, Any]) -> list[str]:
    """kvcalib eval's metrics and checks, the JSON read back as an EvalResult."""
    if "summary_markdown" in data or "metrics" not in data:
        return generic(data)
    result = _read_back(EvalResult, data, "--eval", "kvcalib eval --json")
    try:
        s = result.samples
        lines = [f"Held-out text: {s['source']}, {s['count']} samples ({s['tokens']:,} tokens, "
                 f"≤ {s['max_seq_len']} each), {s['excluded_calibration_rows']} calibration "
                 f"rows excluded; {s['dtype']}, rounding {s['rounding']}. Reference "
                 f"perplexity {result.reference_ppl:.4f}.", "",
                 markdown_table(METRICS_HEADERS, metrics_rows(result.metrics))]
        extra = [f"Verdict: {result.verdict}" if result.verdict else "",
                 passkey_line(result.passkey) if result.passkey else ""]
        if result.separate:  # weights and KV apart, simulated and in vLLM
            extra += separate_summary(result.separate, markdown_table)
        if (result.engine or {}).get("separate"):
            extra += engine_separate_summary(result.engine["separate"], markdown_table)
        checks = [[c.group, c.status, c.message] for c in result.checks]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"--eval: not a `kvcalib eval --json` result ({type(exc).__name__}: "
                         f"{exc})") from None
    for line in extra:  # paragraphs of their own
        lines += ["", line] if line else []
    if checks:
        lines += ["", markdown_table(["check", "status", "detail"], checks)]
    return lines


def _bench(data: dict[str, Any]) -> list[str]:
    """kvcalib bench's table, the JSON read back as a BenchResult: median over the repeats,
    range in brackets."""
    if "summary_markdown" in data or "caches" not in data:
        return generic(data)
    result = _read_back(BenchResult, data, "--bench", "kvcalib bench --json")
    caches = result.caches
    try:
        lines = [workload_line(result.workload) + ". Median over the repeats, range in "
                 "brackets.", "", markdown_table(BENCH_HEADERS, bench_rows(caches))]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"--bench: not a `kvcalib bench --json` result ({type(exc).__name__}: "
                         f"{exc})") from None
    lines += [f"- {c.label}: not measured: {c.reason}" for c in caches if not c.ran]
    useful = [f"{c.label} {c.useful_concurrency}" for c in caches
              if c.ran and c.useful_concurrency is not None]
    if useful:
        lines += ["", f"Useful concurrency (targets {result.targets}): {', '.join(useful)}"]
    return lines


def _lm_eval(data: dict[str, Any]) -> list[str]:
    """`kvcalib lm-eval --json`, read back as an LmEvalResult: accuracy per configuration,
    task and length with its 95% interval, the paired comparisons and the recovery
    sentences, computed again from its examples; else `generic`."""
    if "summary_markdown" in data or "comparisons" not in data:
        return generic(data)
    result = _read_back(LmEvalResult, data, "--lm-eval", "kvcalib lm-eval --json")
    try:
        accuracy = [[row["config"], row["task"], row["length"], row["n"],
                     f"{row['accuracy']:.1%}" + (f" [{row['low']:.1%}, {row['high']:.1%}]"
                                                 if row.get("low") is not None else "")]
                    for row in result.table()]
        pairs = [[f"{c['b']} vs {c['a']}", c["n"], c["only_a"], c["only_b"],
                  f"{c['p_value']:.3g}", f"{c['difference']:+.1%}"
                  + (f" [{c['low']:+.1%}, {c['high']:+.1%}]" if c.get("low") is not None
                     else ""), c["verdict"]] for c in result.comparisons()]
        verdict = [f"- {line}" for line in result.verdict()]  # reads options.min_recovery
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"--lm-eval: not a `kvcalib lm-eval --json` result "
                         f"({type(exc).__name__}: {exc})") from None
    lines = [markdown_table(["config", "task", "length", "n", "accuracy [95%]"], accuracy)]
    if pairs:
        lines += ["", markdown_table(["b vs a", "pairs", "only a right", "only b right",
                                      "McNemar p", "accuracy b - a [95%]", "verdict"], pairs)]
    return [*lines, "", *verdict] if verdict else lines


def generic(data: dict[str, Any]) -> list[str]:
    """Any result JSON, the first shape that fits (see the module docstring)."""
    if isinstance(data.get("summary_markdown"), str):
        return [data["summary_markdown"].strip("\n")]
    rows = data.get("rows")
    if isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows):
        headers = list(dict.fromkeys(key for row in rows for key in row))
        return [markdown_table(headers, [[_plain(row.get(h, "")) for h in headers]
                                         for row in rows])]
    if isinstance(data.get("results"), dict):
        table = _harness_rows(data["results"])
        if table:
            return [markdown_table(["task", "metric", "filter", "value", "stderr"], table)]
    scalars = [[key, _plain(value)] for key, value in data.items()
               if key != "command" and isinstance(value, (str, int, float, bool))]
    if not scalars:
        raise UsageError("a result JSON has nothing to show: no summary_markdown, rows, "
                         "results or top-level values")
    return [markdown_table(["key", "value"], scalars)]


def _harness_rows(results: dict[str, Any]) -> list[list[Any]]:
    """lm-evaluation-harness's {task: {"acc,none": 0.5, "acc_stderr,none": 0.01, ...}}."""
    rows = []
    for task, metrics in results.items():
        if not isinstance(metrics, dict):
            continue
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            rows.append([task, metric, filt or "-", _plain(value),
                         _plain(stderr) if isinstance(stderr, (int, float)) else "-"])
    return rows


def _plain(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
