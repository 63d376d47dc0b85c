"""How the output gets the input's weight files: a copy, a copy-on-write clone or a hard link.

A 70B checkpoint is 140 GB; copying it doubles its disk and takes minutes.

- copy: the bytes are copied, in the kernel (`os.copy_file_range`: no round trip through
  Python, a server-side copy on NFS 4.2, and a clone on XFS or btrfs when it can);
- reflink: a copy-on-write clone (the FICLONE ioctl): nothing is written, and the output
  is an independent file (XFS, btrfs, bcachefs, OCFS2, ZFS 2.2...);
- link: a hard link: nothing is written, but input and output are then the same file,
  so editing an input file in place changes the output too (replacing it does not);
- auto: reflink where the filesystem supports it, else copy.

Every mode gives a normal folder of regular files with bit-identical weights.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from kvcalib.errors import UsageError

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h


def choose(requested: str, sources: list[Path], target_dir: Path) -> tuple[str, str]:
    """The mode (a choices.WeightsMode) to place `sources` into `target_dir` with, and why.

    Runs before calibration, so that a link or clone the filesystem cannot make is
    refused at once rather than after hours of calibration.
    """
    if requested == "copy":
        return "copy", "requested"
    if requested == "link":
        device = os.stat(target_dir).st_dev
        for source in sources:
            if os.stat(source).st_dev != device:
                raise UsageError(f"--weights link: {source} is on another filesystem than "
                                 f"{target_dir}, and hard links cannot cross filesystems; "
                                 "use --weights copy (or reflink where the filesystem clones)")
        return "link", "requested; editing the input files in place would change the output"
    problem = _clone_problem(sources[0], target_dir)
    if requested == "reflink":
        if problem:
            raise UsageError(f"--weights reflink: cannot clone {sources[0].name} into "
                             f"{target_dir} ({problem}); use --weights copy, or link on the "
                             "same filesystem")
        return "reflink", "requested"
    if problem:
        return "copy", f"no copy-on-write clone here ({problem})"
    return "reflink", "the filesystem makes copy-on-write clones"


def _clone_problem(source: Path, target_dir: Path) -> str | None:
    """Why `source` cannot be cloned into `target_dir`, or None when it can (by trying)."""
    with tempfile.TemporaryFile(dir=target_dir) as probe, open(source, "rb") as src:
        try:
            fcntl.ioctl(probe.fileno(), FICLONE, src.fileno())
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                return "the input is on another filesystem"
            return f"{os.strerror(exc.errno)}" if exc.errno else str(exc)
    return None


def place(source: Path, target: Path, mode: str) -> None:
    """Make `target` hold `source`'s bytes (symlinks, as in the Hugging Face cache, are
    followed: the output never points back into the input)."""
    if mode == "link":
        os.link(source, target)  # follows a symlinked source
    elif mode == "reflink":
        with open(source, "rb") as src, open(target, "wb") as dst:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
    else:
        _copy(source, target)


def _copy(source: Path, target: Path) -> None:
    try:
        copied = _copy_in_kernel(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        copied = False
    if not copied:
        shutil.copyfile(source, target)  # through user space


def _copy_in_kernel(source: Path, target: Path) -> bool:
    with open(source, "rb") as src, open(target, "wb") as dst:
        remaining = os.fstat(src.fileno()).st_size
        while remaining > 0:
            done = os.copy_file_range(src.fileno(), dst.fileno(), min(remaining, 2**30))
            if done == 0:  # some filesystems say 0 instead of refusing
                return False
            remaining -= done
    return True
