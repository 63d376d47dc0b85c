"""How `kvcalib verify` starts vLLM, as a typed group checked once, when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcalib.choices import OptionGroup, comma_separated, option
from kvcalib.engine.interpreter import vllm_python_option
from kvcalib.errors import UsageError


@dataclass(frozen=True)
class EngineOptions(OptionGroup):
    """How verify starts vLLM."""

    vllm_python: str | None = vllm_python_option()
    kv_cache_dtype: str = option("fp8", "vLLM kv_cache_dtype for the engine check.")
    max_model_len: int | None = option(None, "vLLM max_model_len.", low=1)
    kv_cache_dtype_skip_layers: list[str] | None = option(
        None, "Layers vLLM keeps in the model dtype (indices or sliding_window); repeat or "
        "use commas.", callback=comma_separated)
    compare_auto: bool = option(False, "Also start vLLM with the model-dtype cache and compare "
                                "capacity, greedy outputs and prompt log-probs.",
                                "--compare-auto")
    timeout: float = option(1200, "Seconds to wait for each engine.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.timeout < math.inf:
            raise UsageError(f"--timeout must be a positive number of seconds, not "
                             f"{self.timeout:g}")
