"""The one place a command's result and errors are written.

- the result: its table on standard output; as JSON to --json FILE, or alone on standard
  output with --json -; as JUnit XML to --junit FILE, or alone on standard output with
  --junit -. Files are replaced whole.
- every JSON result records the command line that produced it under "command" (the model
  card prints it under each table).
- errors: one `Error:` line on standard error (never a traceback), the exit code of
  kvcalib.errors' table, and with --json - a JSON object {"error", "exit_code"} on
  standard output, so that a pipeline reading it always gets JSON.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import typer

from kvcalib.checks import CommandResult
from kvcalib.cli._options import STDOUT, engine_log_dir, info, is_stdout, keep_inputs_intact
from kvcalib.errors import UsageError
from kvcalib.writes import write_json, write_text

Measured = TypeVar("Measured", bound=CommandResult)


class Output:
    """Where one command's result goes, from its --json and --junit options."""

    def __init__(self, json_path: Path | None = None, junit: Path | None = None) -> None:
        if is_stdout(json_path) and is_stdout(junit):
            raise UsageError("--json - and --junit - cannot both go to standard output; "
                             "write one of them to a file")
        self.json_path, self.junit = json_path, junit

    @property
    def folder(self) -> Path | None:
        """The folder of a --json FILE, where engine logs go by default."""
        return self.json_path.parent if self.json_path and not is_stdout(self.json_path) else None

    def emit(self, result: CommandResult, summary: str | None = None) -> int:
        """The result where the options send it: its summary (`summary`, else the result's
        own) on standard output, unless JSON or JUnit goes there instead. Returns its exit
        code, for the command to exit with."""
        payload = {"command": command_line(), **result.to_dict()}
        text = result.summary() if summary is None else summary
        if self.junit is not None:
            from kvcalib.tables import junit_xml

            xml = junit_xml(result.suite, result.checks)
            if is_stdout(self.junit):
                text = xml.rstrip("\n")
            else:
                write_text(self.junit, xml)
        if is_stdout(self.json_path):
            typer.echo(json.dumps(payload, indent=1))
            return result.exit_code
        if self.json_path is not None:
            write_json(self.json_path, payload)
        typer.echo(text)
        return result.exit_code


def engine_command_output(command: str, checkpoint: Path, json_path: Path | None,
                          junit: Path | None, log_dir: Path | None, plot: Path | None = None,
                          starts_engine: bool = True) -> tuple[Output, Path | None]:
    """The result sink and vLLM's log folder of a command that serves a checkpoint, with
    every output (the default log folder too) checked against the checkpoint before any
    work."""
    out = Output(json_path, junit)
    logs = engine_log_dir(command, checkpoint, log_dir, out.folder) if starts_engine else None
    keep_inputs_intact([checkpoint], {"--json": json_path, "--junit": junit, "--plot": plot,
                                      "--log-dir" if log_dir else "the default --log-dir": logs})
    return out, logs


def measure_served(command: str, checkpoint: Path, json_path: Path | None,
                   junit: Path | None, log_dir: Path | None, plot: Path | None,
                   measure: Callable[[Path | None], Measured],
                   draw: Callable[[Measured, Path], Path | None]) -> NoReturn:
    """bench's and lm-eval's whole command: check the outputs, `measure(log folder)`,
    emit the result, then `draw` it to --plot (None: nothing ran to draw), and exit."""
    out, logs = engine_command_output(command, checkpoint, json_path, junit, log_dir, plot)
    result = measure(logs)
    code = out.emit(result)
    if plot is not None:  # after the result: a figure that fails loses nothing computed
        drawn = draw(result, plot)
        if drawn is not None:
            info(f"Plot: {drawn}")
    raise typer.Exit(code)


def command_line() -> str:
    """This kvcalib command as a shell would take it back."""
    return shlex.join(["kvcalib", *sys.argv[1:]])


def fail(code: int, message: str) -> NoReturn:
    """Exit with `code`; with --json -, standard output still gets JSON."""
    if _json_on_stdout(sys.argv[1:]):
        typer.echo(json.dumps({"error": message, "exit_code": code}))
    from kvcalib.calibrate.distributed import group_left_open

    if group_left_open():
        # One rank of a failed job: its peers may be gone, and tearing the broken group
        # down at exit can abort the process (SIGABRT seen with gloo) or hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _json_on_stdout(args: list[str]) -> bool:
    """Whether the command line asks for --json - (read from the raw arguments, so that
    it holds even when click cannot parse them)."""
    return f"--json={STDOUT}" in args or any(
        arg == "--json" and value == STDOUT for arg, value in itertools.pairwise(args))
