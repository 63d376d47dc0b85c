"""Writing outputs: each appears whole or not at all, written beside its target, made
durable, then moved into place; a checkpoint folder's target is checked before any work."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from kvcalib.errors import UsageError

# What --overwrite does, as atomic_output_dir does it (run and convert).
OVERWRITE_HELP = "Replace a non-empty --output (only once the new checkpoint is complete)."


def check_output_target(output: Path, model_dir: Path | None, overwrite: bool) -> Path:
    """Refuse targets that would lose data; return the absolute target path."""
    target = Path(os.path.abspath(Path(output).expanduser()))
    if model_dir is not None:
        model = Path(model_dir).resolve()
        resolved = target.resolve()
        if resolved == model or model in resolved.parents:
            raise UsageError(f"--output {output} is inside the input model folder {model}; "
                             "the input is never modified")
        if resolved in model.parents:
            raise UsageError(f"--output {output} contains the input model folder {model}")
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"--output {output} exists and is a file")
        if any(target.iterdir()) and not overwrite:
            raise UsageError(f"--output {output} exists and is not empty; "
                             "pass --overwrite to replace it")
    if not target.parent.is_dir():
        raise UsageError(f"the parent folder of --output does not exist: {target.parent}")
    check_writable_folder(target.parent, "--output", output)
    return target


def check_writable_folder(folder: Path, option: str, path: Path) -> None:
    """The nearest existing folder at or above `folder` must be a folder we can write in
    (missing ones are created when the output is written). Proven by creating and removing
    a file there: os.access says yes to root where nothing can be created (/proc)."""
    for existing in [folder, *Path(os.path.abspath(folder)).parents]:
        if existing.exists():
            if not existing.is_dir():
                raise UsageError(f"{option} {path}: {existing} is a file, not a folder")
            try:
                fd, probe = tempfile.mkstemp(prefix=".kvcalib-probe-", dir=existing)
            except OSError as exc:
                raise UsageError(f"{option} {path}: cannot write in {existing} "
                                 f"({exc.strerror})") from None
            os.close(fd)
            os.unlink(probe)
            return


@contextmanager
def atomic_output_file(target: Path) -> Iterator[Path]:
    """Yield a temporary file beside `target`; it replaces `target` only once complete."""
    target = Path(target)
    _remove_stale_temporaries(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=_temporary_prefix(target), dir=target.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _make_durable(tmp, _umask())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"writing {target} failed: {exc}; nothing was written there") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def new_file(path: Path) -> Iterator[BinaryIO]:
    """Open a file that will become `path`, which must not exist yet.

    The bytes go to a temporary file created exclusively (O_EXCL) beside `path`, which is
    then linked to `path` (failing if that name was taken) and unlinked. So nothing is
    ever opened for writing through an existing name: a hard link to an input file, or a
    file written a moment before under the same name, is refused rather than overwritten.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.link(name, path)
    finally:
        os.unlink(name)


def write_new(path: Path, data: bytes) -> None:
    """`data` as the new file `path` (see new_file: an existing file is never written)."""
    with new_file(path) as f:
        f.write(data)


@contextmanager
def atomic_output_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `target`; move it into place only on success.

    A crash or interrupt leaves nothing at `target`. Without `overwrite`, the move fails
    when `target` appeared meanwhile (another run finished there first); with it, an
    existing `target` is kept until the new folder is complete.
    """
    target = Path(target)
    _remove_stale_temporaries(target)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(target), dir=target.parent))
    except OSError as exc:
        raise UsageError(f"cannot write to {target.parent}: {exc}") from None
    try:
        yield tmp
        umask = _umask()
        for path in tmp.rglob("*"):
            if path.is_file():
                _make_durable(path, umask)
        tmp.chmod(0o777 & ~umask)
        if overwrite and os.path.lexists(target):
            _replace_folder(tmp, target)
        else:
            _remove_empty_folder(target)
            rename_noreplace(tmp, target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise UsageError(f"{target} appeared while this run was working (another run "
                             "writing there?); it was left as it is, and this run's result "
                             "was discarded") from None
        raise UsageError(f"writing {target} failed: {exc}; nothing was written there") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_folder(new: Path, target: Path) -> None:
    """Swap `new` in for `target`; the old folder is removed only once `new` is in place."""
    old = target.parent / f".{target.name}.kvcalib-old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        rename_noreplace(new, target)
    except OSError:
        with contextlib.suppress(OSError):
            rename_noreplace(old, target)
        raise
    if old.is_symlink():
        old.unlink()
    else:
        shutil.rmtree(old)


def _remove_empty_folder(target: Path) -> None:
    """Remove the empty folder (or link to one) check_output_target accepted at `target`.
    Anything put there since stays, and the rename then refuses to replace it."""
    with contextlib.suppress(OSError):
        if not target.is_symlink():
            target.rmdir()
        elif not any(target.iterdir()):
            target.unlink()


# From <linux/fs.h> and <fcntl.h>.
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_LIBC = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_LIBC, "renameat2", None)  # glibc >= 2.28


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move the folder `src` to `dst`, failing with FileExistsError when `dst` exists,
    even if it appeared a moment ago.

    Linux's renameat2(RENAME_NOREPLACE) checks and renames in one step. Where it is
    missing (other systems, filesystems such as NFS that refuse the flag), creating `dst`
    with mkdir claims the name just as atomically, and rename(2) then replaces that empty
    folder, which POSIX allows only while it is empty.
    """
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        raise


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}.kvcalib-tmp-{os.getpid()}-"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _make_durable(path: Path, umask: int) -> None:
    """Usual permissions (mkstemp and some writers create 0600 files), bytes on disk."""
    if path.stat().st_nlink == 1:  # a hard link's mode is the input file's
        path.chmod(0o666 & ~umask)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _remove_stale_temporaries(target: Path) -> None:
    """Remove temporary files and folders that killed runs left beside `target`."""
    for path in target.parent.glob(f".{target.name}.kvcalib-tmp-*"):
        pid = path.name.removeprefix(f".{target.name}.kvcalib-tmp-").split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=1) + "\n")


def write_text(path: Path, text: str) -> None:
    """Replace `path` whole (missing folders are created): a reader never sees half a file."""
    with atomic_output_file(path) as tmp:
        tmp.write_text(text)
