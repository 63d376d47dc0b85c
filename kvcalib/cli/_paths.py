"""Output paths given on the command line, refused before any work: a file that cannot be
written whole, a folder that cannot be made, an output that is or lies in an input."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from kvcalib.errors import UsageError
from kvcalib.reads import allowed_roots
from kvcalib.writes import check_writable_folder


def check_output_file(path: Path, option: str) -> Path:
    """Refuse, before any work, an output file that cannot be written whole: a folder, a
    device or pipe (/dev/full accepts the open and fails the write), a path under a file,
    an unwritable place. Returns the absolute path; a link is followed, so the file it
    names is the one replaced."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name")
    if target.exists():
        if not target.is_file():
            raise UsageError(f"{option} {path} is not a regular file (a device or pipe); "
                             "kvcalib writes output files whole")
        if not os.access(target, os.W_OK):
            raise UsageError(f"{option} {path} is not writable")
    check_writable_folder(target.parent, option, path)
    return target.resolve()


def check_output_folder(path: Path, option: str) -> Path:
    """Refuse, before any work, an output folder that is a file or cannot be created."""
    target = Path(path).expanduser()
    check_writable_folder(target, option, path)
    return Path(os.path.abspath(target))


def refuse_outputs_in_inputs(inputs: list[Path | str | None],
                             outputs: dict[str, Path | None]) -> None:
    """Refuse, before any work, an output (option -> path) that is an input or lies inside
    an input folder: compared resolved through symbolic links, and an existing file also
    by inode (a hard link to an input's file). Inputs that are not local paths (hub ids)
    are skipped."""
    sources = [Path(p).expanduser() for p in inputs if p is not None]
    sources = [p for p in sources if p.exists()]
    roots = [root for p in sources if p.is_dir() for root in allowed_roots(p)]
    for option, path in outputs.items():
        if path is None:
            continue
        real = Path(path).expanduser().resolve()
        for source in sources:
            if real == source.resolve():
                raise UsageError(f"{option} {path} is the input {source}; the input is never "
                                 "modified")
        for root in roots:
            if root in real.parents:
                raise UsageError(f"{option} {path} is inside the input folder {root}; the "
                                 "input is never modified")
        linked = _same_file_among(real, sources)
        if linked is not None:
            raise UsageError(f"{option} {path} is a hard link to the input's {linked}; the "
                             "input is never modified")


def _same_file_among(path: Path, sources: list[Path]) -> Path | None:
    """An input file that is `path` under another name (a hard link), if any."""
    try:
        info = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink < 2:
        return None
    for source in sources:
        for candidate in ([source] if source.is_file() else source.rglob("*")):
            with contextlib.suppress(OSError):
                if os.path.samestat(candidate.stat(), info):
                    return candidate
    return None


