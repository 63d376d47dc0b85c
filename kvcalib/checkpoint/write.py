"""Writing a checkpoint: the input's files placed in the output, the KV scales in a file of
their own, and the index and config pointing at them. `run` and `convert` both write here.

The input's weight files come as a copy, a copy-on-write clone or a hard link. A 70B
checkpoint is 140 GB; copying it doubles its disk and takes minutes.

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
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from kvcalib.checkpoint import layouts
from kvcalib.checkpoint.calibration_report import REPORT_FILE
from kvcalib.checkpoint.read import Checkpoint
from kvcalib.checkpoint.safetensors import (
    INDEX_NAME,
    LONE_NAME,
    RawTensor,
    copy_tensors,
    file_tensors,
    read_raw,
    weight_files,
    write_tensors,
)
from kvcalib.errors import CheckpointError, UsageError
from kvcalib.reads import load_config, read_json
from kvcalib.writes import new_file, write_new

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
SCALES_FILE = "kv_scales.safetensors"
RECIPE_FILE = "recipe.yaml"


def choose_placement(requested: str, sources: list[Path], target_dir: Path) -> tuple[str, str]:
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
    """Make the new file `target` hold `source`'s bytes (symlinks, as in the Hugging Face
    cache, are followed: the output never points back into the input). `target` must not
    exist: every mode fails rather than write through an existing name (files.new_file)."""
    if mode == "link":
        os.link(source, target)  # follows a symlinked source; refuses an existing target
        return
    with open(source, "rb") as src, new_file(target) as dst:
        if mode == "reflink":
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
        else:
            _copy(src, dst)


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    """In the kernel where it can (copy_file_range), else through user space."""
    remaining = os.fstat(src.fileno()).st_size
    try:
        while remaining > 0:
            done = os.copy_file_range(src.fileno(), dst.fileno(), min(remaining, 2**30))
            if done == 0:  # some filesystems say 0 instead of refusing
                break
            remaining -= done
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    if remaining > 0:  # start again from the beginning, through user space
        src.seek(0)
        dst.seek(0)
        dst.truncate()
        shutil.copyfileobj(src, dst, 2**24)


def write_checkpoint(out: Path, source: Checkpoint, scales: dict[str, RawTensor],
                     quant_config: dict[str, Any], weights: str = "copy",
                     leave_out: tuple[str, ...] = ()) -> None:
    """`source` into `out` with `scales` as its KV scales and `quant_config` as its
    quantization_config; every other tensor's bytes are the input's (see copy_weights)."""
    weight_map = copy_weights(out, source, leave_out, weights)
    write_tensors(out / SCALES_FILE, scales)
    weight_map.update(dict.fromkeys(scales, SCALES_FILE))
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_NAME, index)
    _write_json(out / "config.json", {**source.config, "quantization_config": quant_config})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_new(path, (json.dumps(data, indent=2) + "\n").encode())


# Names kvcalib writes itself; an input weight file never takes one.
RESERVED = frozenset({SCALES_FILE, INDEX_NAME, "config.json", REPORT_FILE, RECIPE_FILE})


def output_names(files: list[str]) -> dict[str, str]:
    """The output name of each input weight file, all decided before anything is written,
    none twice and none of RESERVED.

    A lone model.safetensors becomes a one-shard file, because transformers ignores the
    index when model.safetensors exists; when that name (or a reserved one) is already an
    input file's, a numbered name is taken instead.
    """
    names: dict[str, str] = {}
    taken = set(RESERVED) | {f for f in files if f != LONE_NAME}
    for src in files:
        wanted = "model-00001-of-00001.safetensors" if src == LONE_NAME else src
        if wanted in RESERVED or (wanted != src and wanted in taken):
            stem = Path(wanted).stem
            wanted = next(name for n in range(1, len(files) + 2) if
                          (name := str(Path(wanted).with_name(f"{stem}-{n}.safetensors")))
                          not in taken)
        taken.add(wanted)
        names[src] = wanted
    return names


def copy_weights(out: Path, source: Checkpoint, leave_out: tuple[str, ...] = (),
                 weights: str = "copy") -> dict[str, str]:
    """Copy every file of `source` but its config, index and calibration outputs (and
    `leave_out`) into `out`; return the weight map of the copied tensors.

    Weight files are placed as `weights` says, byte for byte; a file that holds KV scale
    tensors is rewritten without them. A lone model.safetensors becomes a one-shard file,
    because transformers ignores the index when model.safetensors exists.
    """
    names = output_names(list(source.weight_files))
    copy_side_files(out, source.folder, leave_out)
    weight_map, _ = _weight_files_without_scales(
        out, source.folder, names, lambda src, target: place(src, target, weights))
    return weight_map


def _weight_files_without_scales(out: Path, folder: Path, names: dict[str, str],
                                 place_file: Callable[[Path, Path], None],
                                 ) -> tuple[dict[str, str], list[str]]:
    """Each weight file of `folder` into `out` under its name in `names`: rewritten without
    its KV scale tensors when it holds any, else put there by `place_file(source, target)`.
    Returns the weight map of the tensors kept and the scale tensors left out."""
    weight_map: dict[str, str] = {}
    dropped: list[str] = []
    for src, name in names.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        tensors = file_tensors(folder, src)
        found, twice = layouts.find_scales(tensors)
        scales = {s.info.name for s in found} | set(twice)
        if scales:
            copy_tensors(folder, src, out / name, drop=scales)
        else:
            place_file(folder / src, out / name)
        dropped += sorted(scales)
        weight_map.update({t: name for t in tensors if t not in scales})
    return weight_map, dropped


def copy_side_files(out: Path, model_dir: Path, leave_out: tuple[str, ...] = ()) -> None:
    """Copy what is not weights, config, index or calibration output (tokenizer, generation
    config...) from `model_dir` into `out`, but `leave_out`."""
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors" or item.name in (INDEX_NAME, REPORT_FILE, RECIPE_FILE,
                                                          "config.json", *leave_out):
            continue
        copy = shutil.copytree if item.is_dir() else shutil.copyfile
        copy(item, out / item.name)


def write_without_kv_scales(folder: Path, out: Path) -> list[str]:
    """`folder` with no KV scales, into the empty folder `out`, for vLLM to serve an FP8
    cache at scale 1.0 with the same weights (what it does when a checkpoint has none).

    Files are linked as _linked_view says; config.json loses the kv_cache_scheme (and a
    quantization_config that declared nothing else). Returns the scale tensors left out.
    """
    weight_map, dropped = _linked_view(folder, out)
    _write_index(folder, out, weight_map)
    config = load_config(folder)
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and "kv_cache_scheme" in quant:
        quant = layouts.without_kv_cache(quant, folder)
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        if quant is not None:
            config["quantization_config"] = quant
    _write_json(out / "config.json", config)
    return dropped


def write_with_kv_scales(folder: Path, scales_from: Checkpoint, out: Path) -> list[str]:
    """`folder`'s weights with the KV scales of `scales_from` (a compressed-tensors
    checkpoint of the same model), into the empty folder `out`: the unquantized model with
    a weight-quantized checkpoint's KV cache, for vLLM to serve the KV-only row of
    `eval --engine`.

    Files are linked as _linked_view says; the scales are copied byte for byte into
    SCALES_FILE, and config.json declares a KV-only compressed-tensors quantization_config
    with `scales_from`'s kv_cache_scheme. Returns the scale tensors written.
    """
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    quant = (scales_from.config or {}).get("quantization_config")
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if not isinstance(scheme, dict) or quant.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{scales_from.folder} declares no compressed-tensors "
                              "kv_cache_scheme to carry over")
    try:
        kv_args = QuantizationArgs.model_validate(scheme)
    except ValidationError as exc:
        raise CheckpointError(f"{scales_from.folder}'s kv_cache_scheme is not compressed-"
                              f"tensors' QuantizationArgs: {exc.errors()[0]['msg']}") from None
    weight_map, _ = _linked_view(folder, out)
    scales = {s.info.name: read_raw(s.info) for s in layouts.find_scales(scales_from.tensors)[0]}
    write_tensors(out / SCALES_FILE, scales)
    weight_map.update(dict.fromkeys(scales, SCALES_FILE))
    _write_index(folder, out, weight_map, always=True)
    _write_json(out / "config.json", {**load_config(folder),
                                      "quantization_config": layouts.kv_only_config(kv_args)})
    return sorted(scales)


def _linked_view(folder: Path, out: Path) -> tuple[dict[str, str], list[str]]:
    """`folder`'s files in `out` as symbolic links (read only, never written through), but
    its index and config (the caller writes them) and its calibration report and recipe
    (they describe its scales); a weight file holding KV scales is rewritten without them.
    Returns the weight map of the linked tensors and the scale tensors left out."""
    names = {name: name for name in weight_files(folder)}
    weight_map, dropped = _weight_files_without_scales(
        out, folder, names, lambda source, target: target.symlink_to(source.resolve()))
    for item in folder.iterdir():
        if not (out / item.name).exists() and item.name not in (INDEX_NAME, "config.json",
                                                                REPORT_FILE, RECIPE_FILE):
            (out / item.name).symlink_to(item.resolve())
    return weight_map, dropped


def _write_index(folder: Path, out: Path, weight_map: dict[str, str],
                 always: bool = False) -> None:
    """`folder`'s safetensors index (if it has one, or `always`) with `weight_map`."""
    if (folder / INDEX_NAME).exists():
        # weight_files has read and checked this index: a JSON object with a weight_map.
        index = read_json(folder, INDEX_NAME, what="safetensors index")
    elif always:
        index = {"metadata": {}}
    else:
        return
    index["weight_map"] = dict(sorted(weight_map.items()))
    _write_json(out / INDEX_NAME, index)
