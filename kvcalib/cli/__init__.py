"""The `kvcalib` command: one small module per command over the library, as thin as
Typer allows. Shared options are in _options, the result and error sink in _output.

Exit codes (kvcalib.errors): 0 ok, 1 a check (or calibration) failed, 2 usage or
environment error, 130 interrupted. Every output path is checked while the command line
is parsed, before any work, and numeric options carry their ranges.
"""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

import typer

from kvcalib.cli import (
    bench,
    card,
    convert,
    demo,
    estimate,
    evaluate,
    inspect,
    lm_eval,
    run,
    verify,
)
from kvcalib.cli._output import fail
from kvcalib.errors import INTERRUPTED, KvcalibError

app = typer.Typer(
    help="Calibrate, verify and evaluate FP8 KV-cache scales for vLLM checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for name, command in (("run", run.run), ("verify", verify.verify), ("eval", evaluate.evaluate),
                      ("estimate", estimate.estimate), ("inspect", inspect.inspect),
                      ("convert", convert.convert), ("demo-model", demo.demo_model),
                      ("bench", bench.bench), ("lm-eval", lm_eval.lm_eval), ("card", card.card),
                      ("demo", demo.demo)):
    app.command(name)(command)


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt  # so that cleanup (temporary output folders) runs


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = app(standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        code = INTERRUPTED
    except typer.TyperException as exc:  # bad command line: click's message, exit 2
        exc.show()
        fail(exc.exit_code, exc.format_message())
    except KvcalibError as exc:
        typer.echo(f"Error: {exc}", err=True)
        fail(exc.exit_code, str(exc))
    # Typer itself turns KeyboardInterrupt (Ctrl-C, SIGTERM above) into this exit code,
    # silently (typer/core.py, _main).
    if code == INTERRUPTED:
        typer.echo("Interrupted; nothing was written.", err=True)
        fail(INTERRUPTED, "interrupted; nothing was written")
    sys.exit(code if isinstance(code, int) else 0)
