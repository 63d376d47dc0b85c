"""kvcalib: calibrate, verify and evaluate FP8 KV-cache scales for vLLM checkpoints.

The public API is imported lazily, so that light commands (`verify --static-only`,
`estimate`, `inspect`) start without loading torch.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_API = {
    "calibrate": "kvcalib.calibration",
    "CalibrationResult": "kvcalib.calibration",
    "verify": "kvcalib.verification",
    "VerifyResult": "kvcalib.verification",
    "evaluate": "kvcalib.evaluation",
    "EvalResult": "kvcalib.evaluation",
    "estimate": "kvcalib.capacity",
    "inspect": "kvcalib.inspection",
    "prepare_demo_model": "kvcalib.demo_model",
    "UsageError": "kvcalib.errors",
    "CheckFailed": "kvcalib.errors",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'kvcalib' has no attribute {name!r}")
