"""Stage `kvcalib lm-eval`: task accuracy through lm-evaluation-harness's vLLM backend with
the model-dtype cache, FP8 at scale 1.0 and FP8 with the checkpoint's scales, paired
example by example (run.lm_eval)."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "LmEvalOptions": "options", "LmEvalResult": "result", "lm_eval": "run"})
