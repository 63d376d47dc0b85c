"""Stage 4, `kvcalib eval`: what an FP8 KV cache (or any vLLM KV format) costs in accuracy,
simulated against the exact model; run.evaluate is the entry point (it needs torch)."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "evaluate": "run", "EvalResult": "result", "CALIBRATED": "metrics", "E5M2": "metrics",
    "SCALE_ONE": "metrics", "Metrics": "metrics", **dict.fromkeys(
        ["EngineCheck", "EvalOptions", "Formats", "Gates", "HeldOut", "LayerSweep", "Passkey",
         "SimulationOptions"], "options")})
