"""Stage 4, `kvcalib eval`: what an FP8 KV cache (or any vLLM KV format) costs in accuracy,
simulated against the exact model; run.evaluate is the entry point. It needs torch, so it
is imported on first use: options and results are read without it."""

from typing import Any

from kvcalib.evaluate.metrics import CALIBRATED, E5M2, SCALE_ONE, Metrics
from kvcalib.evaluate.options import (
    EngineCheck,
    EvalOptions,
    Formats,
    Gates,
    HeldOut,
    LayerSweep,
    Passkey,
    Simulation,
)
from kvcalib.evaluate.result import EvalResult

__all__ = ["CALIBRATED", "E5M2", "SCALE_ONE", "EngineCheck", "EvalOptions", "EvalResult",
           "Formats", "Gates", "HeldOut", "LayerSweep", "Metrics", "Passkey", "Simulation",
           "evaluate"]


def __getattr__(name: str) -> Any:
    if name == "evaluate":
        from kvcalib.evaluate.run import evaluate

        return evaluate
    raise AttributeError(f"module 'kvcalib.evaluate' has no attribute {name!r}")
