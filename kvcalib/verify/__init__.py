"""Stage 3, `kvcalib verify`: the static checks, then vLLM started in the serving
environment (engine, probe/) and every loaded scale read back (run.verify)."""

from kvcalib.verify.run import EngineOptions, VerifyResult, verify

__all__ = ["EngineOptions", "VerifyResult", "verify"]
