"""Data-parallel calibration on torch.distributed, launched by torchrun.

llm-compressor 0.14.0.1 all-reduces observer statistics across ranks when a calibration
epoch ends (observers/base.py `sync_activation_stats`): `static_minmax` with MAX, so the
scales are exactly those of one process seeing every sample. kvcalib gives each rank a
disjoint share of the same seeded sample list, gathers what its own hooks saw, and lets
rank 0 alone write the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvcalib.errors import INTERRUPTED, CheckFailed, UsageError


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job; one process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str | None = None
    initialized_here: bool = False

    @property
    def writer(self) -> bool:
        """Rank 0 writes the checkpoint and prints; the other ranks write nothing."""
        return self.rank == 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


@contextlib.contextmanager
def joined() -> Iterator[Ranks]:
    """This process's ranks for one calibration. A process group started here is closed
    after success; after a failure the process is about to exit, and closing a group
    whose peers are gone can hang."""
    ranks = _setup()
    yield ranks
    if ranks.initialized_here:
        import torch.distributed as dist

        dist.destroy_process_group()


def group_left_open() -> bool:
    """Whether a process group is still open: `joined` closes it only after success."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _setup() -> Ranks:
    """Join the job torchrun started: nccl on GPUs, gloo on CPUs.

    compressed-tensors' `init_dist` picks the backend from the accelerator and needs
    one, so without a GPU kvcalib starts the gloo process group itself.
    """
    if sys.modules.get("torch") is None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Ranks()  # one process, and no group can exist yet: no need to load torch
    import torch
    import torch.distributed as dist

    initialized_here = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return Ranks()
        if torch.accelerator.current_accelerator() is not None:
            from compressed_tensors.distributed import init_dist

            if not under_torchrun():
                raise UsageError("WORLD_SIZE is set but this process was not started by "
                                 "torchrun; start kvcalib with torchrun or --nproc-per-node")
            init_dist()
        else:
            dist.init_process_group("gloo", init_method="env://")
        initialized_here = True
    return Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(),
                 local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                 backend=str(dist.get_backend()), initialized_here=initialized_here)


def shares(count: int, world_size: int) -> list[range]:
    """Each rank's contiguous share of `count` samples, in rank order (llm-compressor's
    rule, datasets/utils.py `get_rank_partition`): sizes differ by at most one."""
    if count < world_size:
        raise UsageError(f"{count} samples cannot be shared by {world_size} ranks; every "
                         "rank needs at least one")
    return [range(count * r // world_size, count * (r + 1) // world_size)
            for r in range(world_size)]


def summary(ranks: Ranks, parts: list[range], rows: list[int]) -> dict[str, Any]:
    """For the report: the job's size and backend, and each rank's samples (1-based,
    first and last) and their dataset rows."""
    return {"world_size": ranks.world_size, "backend": ranks.backend,
            "ranks": [{"rank": rank, "samples": [part.start + 1, part.stop],
                       "rows": rows[part.start:part.stop]}
                      for rank, part in enumerate(parts)]}


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a broken collective (a rank died or failed) into one clear error."""
    try:
        yield
    except RuntimeError as exc:  # gloo and nccl report lost peers as RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckFailed(f"lost contact with another rank while {what} ({first}); that "
                          "rank failed or was stopped, see its error. Nothing was written"
                          ) from None


def all_gather(value: Any, ranks: Ranks, what: str) -> list[Any]:
    """Every rank's `value`, in rank order (only this rank's own on one process)."""
    if ranks.world_size == 1:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * ranks.world_size
    with collective(what):
        dist.all_gather_object(gathered, value)
    return gathered


def barrier(ranks: Ranks, what: str) -> None:
    if ranks.world_size > 1:
        import torch.distributed as dist

        with collective(what):
            dist.barrier()


# ----- launching: `kvcalib run --nproc-per-node N` ----- #


def check_nproc(nproc: int) -> None:
    """Refuse process counts that cannot work here, before anything starts."""
    import torch

    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {nproc}")
    if under_torchrun():
        raise UsageError("--nproc-per-node starts torchrun; this process already runs "
                         "under torchrun, so leave the option out")
    if torch.cuda.is_available():
        if nproc > torch.cuda.device_count():
            raise UsageError(f"--nproc-per-node {nproc}: this node has only "
                             f"{torch.cuda.device_count()} GPUs (one rank per GPU)")
    elif nproc > (os.cpu_count() or 1):
        raise UsageError(f"--nproc-per-node {nproc}: this machine has only "
                         f"{os.cpu_count()} CPU cores and no GPU")


def launch(nproc: int, kvcalib_args: list[str]) -> int:
    """Run `kvcalib <args>` on `nproc` ranks of this node through torchrun's own launcher
    (without --nproc-per-node: each rank is one process of the job).

    Returns the exit code. A rank that failed with kvcalib's own error (exit 1 or 2)
    already printed it; a rank that died otherwise (a signal, an out-of-memory kill) is
    reported here, in one line, even when a peer's error came first (its collective lost
    the dead rank). torchrun stops the other ranks either way; Ctrl-C or SIGTERM to the
    launcher is an interrupt, as for one process, once torchrun has stopped the ranks.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1 (and print a banner); share the node's cores instead.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # failures are reported here
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "kvcalib",
         *_without_option(kvcalib_args, "--nproc-per-node")])
    try:
        torchrun(args)
    except SignalException:
        raise KeyboardInterrupt from None
    except ChildFailedError as exc:
        # torchrun stops the others with SIGTERM, which kvcalib takes as an interrupt (130)
        died = {rank: f for rank, f in exc.failures.items()
                if f.exitcode not in (1, 2, INTERRUPTED)}
        if not died:
            if any(f.exitcode == INTERRUPTED for f in exc.failures.values()):
                raise KeyboardInterrupt from None  # the ranks had Ctrl-C too
            return exc.get_first_failure()[1].exitcode
        rank = min(died)
        raise CheckFailed(f"rank {rank} of {nproc} {_died(died[rank].exitcode)}; torchrun "
                          "stopped the other ranks and nothing was written") from None
    return 0


def _without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without `name VALUE` or `name=VALUE`."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith(f"{name}="):
            skip = False
            continue
        skip = arg == name
        if not skip:
            kept.append(arg)
    return kept


def _died(exitcode: int) -> str:
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
        return f"was killed by signal {-exitcode}"
    if exitcode == 130:
        return "was interrupted"
    return f"exited with code {exitcode}"
