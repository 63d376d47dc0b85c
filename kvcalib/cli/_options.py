"""Options several commands share, and `grouped`, which turns a command's option groups
(the library's frozen dataclasses, as llm-compressor's args/ are) into Typer options.

Each field of a group is declared once, in the library, with `kvcalib.choices.option`:
its default, help and bounds; its Literal type gives the choices. The CLI flattens the
groups into options and builds them again before the command runs, so the command gets
typed, checked objects and passes them on as they are.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import typer

from kvcalib.choices import flag, hints
from kvcalib.cli._paths import check_output_file, check_output_folder, refuse_outputs_in_inputs
from kvcalib.errors import UsageError
from kvcalib.writes import OVERWRITE_HELP

STDOUT = "-"


def is_stdout(path: Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def _output_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """An output file option, checked while parsing ('-' is standard output)."""
    if value is None or is_stdout(value):
        return value
    return check_output_file(value, param.opts[0])


def output_folder(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """An output folder option, checked while parsing."""
    return None if value is None else check_output_folder(value, param.opts[0])


def _plot_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """A figure file, checked while parsing. Its extension names the format; a name
    without one gets '.png' (as matplotlib would add), so the path printed is the one
    written."""
    if value is None:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    option = param.opts[0]
    if is_stdout(value):
        raise UsageError(f"{option} writes a file; give a file name such as scales.png")
    path = check_output_file(value, option)
    if not path.suffix:
        path = check_output_file(path.with_name(path.name + ".png"), option)
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise UsageError(f"{option} {value}: unsupported plot format {path.suffix!r}; use "
                         f"one of {', '.join('.' + name for name in sorted(formats))}")
    return path


JsonOut = Annotated[Path | None, typer.Option(
    "--json", callback=_output_file,
    help="Also write the result as JSON to this file (a regular file, replaced whole); "
         "'-' prints the JSON to standard output instead of the table, and on errors "
         "{\"error\": ..., \"exit_code\": N}.")]
JunitOut = Annotated[Path | None, typer.Option(
    callback=_output_file, help="Write JUnit XML for CI to this file; '-' prints it to "
                                "standard output instead of the table.")]
OutputFolder = Annotated[Path, typer.Option(help="Folder for the checkpoint.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)]


def folder_option(help: str) -> Any:
    return Annotated[Path | None, typer.Option(callback=output_folder, help=help)]


def plot_option(help: str) -> Any:
    return Annotated[Path | None, typer.Option(
        callback=_plot_file, help=f"{help} Its extension names the format; a name without one "
                                  "gets .png.")]


def keep_inputs_intact(inputs: list[Any], outputs: dict[str, Path | None]) -> None:
    """Before any work: no output file or folder (option -> path) may be or lie inside an
    input ('-', standard output, is none)."""
    refuse_outputs_in_inputs(inputs, {option: path for option, path in outputs.items()
                                      if not is_stdout(path)})


def engine_log_dir(command: str, checkpoint: Path, given: Path | None,
                   json_folder: Path | None) -> Path:
    """Where vLLM's logs go: --log-dir, else beside --json, else
    ./kvcalib-COMMAND-logs/NAME (which keep_inputs_intact must also see: the current
    folder may be inside the checkpoint)."""
    from kvcalib.engine.process import log_folder

    return given or json_folder or log_folder(command, checkpoint)


def info(message: str) -> None:
    """Progress and notes: standard error, so that standard output stays the result."""
    typer.echo(message, err=True)


# ----- option groups ----- #


def grouped(command: Callable[..., Any]) -> Callable[..., Any]:
    """Let a Typer command take option groups: a parameter whose type is a group becomes
    its fields' options, with the parameter's default (a group) giving their defaults, and
    the command receives the group built from them. Groups nest; an optional one
    (`Group | None`, default None) is built only when its first option is given."""
    signature = inspect.signature(command, eval_str=True)
    flat: list[inspect.Parameter] = []
    builders = {}
    for param in signature.parameters.values():
        if dataclasses.is_dataclass(param.annotation):
            builders[param.name] = _flatten(param.annotation, param.default, flat)
        else:  # Typer passes every value by name
            flat.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    def run(**kwargs: Any) -> Any:
        for name, build in builders.items():
            kwargs[name] = build(kwargs)
        return command(**kwargs)

    run.__name__, run.__doc__ = command.__name__, command.__doc__
    run.__signature__ = signature.replace(parameters=flat)  # type: ignore[attr-defined]
    run.__annotations__ = {param.name: param.annotation for param in flat}
    return run


def _flatten(group: type, default: Any, out: list[inspect.Parameter]
             ) -> Callable[[dict[str, Any]], Any]:
    """Append `group`'s options to `out`; return what builds the group from the parsed
    values (popping them)."""
    parts: dict[str, Callable[[dict[str, Any]], Any]] = {}
    for field in dataclasses.fields(group):
        kind = hints(group)[field.name]
        value = None if default is None else getattr(default, field.name)
        nested = next((t for t in (kind, *get_args(kind)) if dataclasses.is_dataclass(t)), None)
        if nested is not None:
            parts[field.name] = _flatten(nested, value, out)
        elif "help" in field.metadata:  # fields without one are not options
            out.append(_parameter(field, kind, value))
            parts[field.name] = lambda values, name=field.name: values.pop(name)

    def build(values: dict[str, Any]) -> Any:
        given = {name: part(values) for name, part in parts.items()}
        if default is None and next(iter(given.values())) is None:
            return None
        return group(**given)

    return build


def _parameter(field: dataclasses.Field, kind: Any, default: Any) -> inspect.Parameter:
    meta = field.metadata
    names = meta["names"] or (flag(field.name),)
    extra = dict(meta["cli"])
    if meta["comma"] is not None:
        kind = str | None
        default = ",".join(map(str, default)) or None
        extra["callback"] = _comma_list(meta["comma"], names[0], meta["low"], meta["high"])
    elif _number(kind):
        extra.update(min=meta["low"], max=meta["high"])
    option = typer.Option(*names, help=meta["help"], **extra)
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, option])


def _number(kind: Any) -> bool:
    if get_origin(kind) in (Union, type(int | None)):
        return any(_number(arg) for arg in get_args(kind))
    return kind in (int, float)


def _comma_list(kind: type, option: str, low: float | None, high: float | None
                ) -> Callable[[str], list[Any]]:
    """'1024,2048' -> [1024, 2048]; anything else is a usage error worded as for the
    options' own ranges."""
    def parse(text: str) -> list[Any]:
        parts = [part.strip() for part in (text or "").split(",") if part.strip()]
        try:
            values = [kind(part) for part in parts]
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a comma-separated list of numbers",
                                     param_hint=f"'{option}'") from None
        for value in values:
            if (low is not None and value < low) or (high is not None and value > high):
                bound = f"between {low} and {high}" if high is not None else f">= {low}"
                raise typer.BadParameter(f"{value} is not {bound}", param_hint=f"'{option}'")
        return values
    return parse
