"""`kvcalib card`: the model card a release publishes, written into the checkpoint's
README.md (or updated there, between its markers, leaving the rest as it is)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.cli._options import info, keep_inputs_intact
from kvcalib.cli._paths import check_output_file
from kvcalib.errors import UsageError


def _card_file(value: Path | None) -> Path | None:
    """--output, checked while parsing."""
    return None if value is None else check_output_file(value, "--output")


def card(
    checkpoint: Annotated[Path, typer.Argument(help="The calibrated checkpoint folder.")],
    eval_json: Annotated[Path | None, typer.Option(
        "--eval", help="JSON of `kvcalib eval --json`: its metrics and checks; its skip-layer "
                       "recommendation (--sweep --max-kl) goes into the serving command.")] = None,
    bench_json: Annotated[Path | None, typer.Option(
        "--bench", help="JSON of `kvcalib bench --json`: latency and throughput per cache.")
    ] = None,
    lm_eval_json: Annotated[Path | None, typer.Option(
        "--lm-eval", help="JSON of an lm-eval run: 'summary_markdown', 'rows' (a list of "
                          "objects) or lm-evaluation-harness's 'results', with 'command'.")
    ] = None,
    base_model: Annotated[str | None, typer.Option(
        help="The base model's hub id for the front matter (default: the input model, when "
             "`run` downloaded it from the Hub).")] = None,
    name: Annotated[str | None, typer.Option(
        help="What users serve it by, in the title and the serving command, e.g. its hub id "
             "(default: the folder's name).")] = None,
    output: Annotated[Path | None, typer.Option(
        callback=_card_file, help="Write the card to this file instead of CHECKPOINT/README.md "
                                   "(updated the same way when it exists).")] = None,
    print_only: Annotated[bool, typer.Option(
        "--print", "--dry-run", help="Print the card to standard output; write nothing.")
    ] = False,
) -> None:
    """Write the checkpoint's model card: front matter for the Hub (base_model, quantized,
    library vllm, tags), the serving command, the calibration's provenance and the tables
    of --eval, --bench and --lm-eval, each with the command that produced it. An existing
    README keeps everything outside <!-- kvcalib:begin --> ... <!-- kvcalib:end -->."""
    from kvcalib.checkpoint.calibration_report import REPORT_FILE, load_report
    from kvcalib.engine.targets import checkpoint_serving
    from kvcalib.reads import read_bounded
    from kvcalib.report.card import (
        Results,
        default_base_model,
        load_result,
        measured_elsewhere,
        render_card,
    )
    from kvcalib.writes import write_text

    if print_only and output is not None:
        raise UsageError("--print writes nothing; drop --output")
    if not checkpoint.is_dir():
        raise UsageError(f"checkpoint folder not found: {checkpoint}")
    report = load_report(checkpoint)
    if report is None:
        raise UsageError(f"{checkpoint} has no {REPORT_FILE}: `kvcalib card` describes a "
                         "checkpoint that `kvcalib run` wrote")
    target = None if print_only else output or check_output_file(checkpoint / "README.md",
                                                                  "the README")
    sources = {"--eval": eval_json, "--bench": bench_json, "--lm-eval": lm_eval_json}
    keep_inputs_intact([checkpoint / REPORT_FILE, checkpoint / "config.json",
                        *sources.values()], {"--output": target})
    results = Results(*(load_result(path, option) if path else None
                        for option, path in sources.items()))
    existing = ""
    readme = target or checkpoint / "README.md"  # --print: the card it would write
    if readme.exists():
        raw = read_bounded(readme.parent, readme.name, what="README")
        try:
            existing = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{readme} is not UTF-8 text") from None
    for note in measured_elsewhere(results, checkpoint):
        info(f"Note: {note}")
    written = render_card(report, existing, name or checkpoint.resolve().name,
                          base_model or default_base_model(report), results,
                          checkpoint_serving(checkpoint))
    for note in written.notes:
        info(f"Note: {note}")
    if target is None:
        typer.echo(written.text, nl=False)
        return
    write_text(target, written.text)  # a new file renamed into place: a hard link is not
    info(f"Wrote {target}")           # written through
