"""Stage 3, `kvcalib verify`: the static checks, then vLLM started in the serving
environment (kvcalib.engine) and every loaded scale read back (run.verify)."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "EngineOptions": "options", "VerifyResult": "run", "verify": "run"})
