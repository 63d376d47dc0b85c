"""What `kvcalib bench` measures and how it starts vLLM, as a typed group checked once."""

from __future__ import annotations

from dataclasses import dataclass

from kvcalib.choices import OptionGroup, option
from kvcalib.engine.interpreter import vllm_python_option
from kvcalib.errors import UsageError
from kvcalib.kvcache.capacity import parse_budget


@dataclass(frozen=True)
class BenchOptions(OptionGroup):
    """The workload, the caches compared, the targets, and how vLLM starts."""

    kv_cache_dtypes: list[str] = option(["auto", "fp8"], "KV caches to compare (vLLM "
                                        "kv_cache_dtype names), comma separated.",
                                        "--kv-cache-dtypes", comma=str)
    input_len: int = option(128, "Prompt tokens per request (random tokens).", low=1)
    output_len: int = option(32, "Generated tokens per request (EOS ignored).", low=1)
    num_prompts: int = option(16, "Requests per measurement.", low=1)
    concurrency: list[int] = option([1, 4], "Concurrent requests, comma separated: one "
                                    "measurement each.", comma=int, low=1)
    repeats: int = option(3, "Measurements per cache and concurrency (their median and "
                          "range are reported).", low=1)
    kv_budget: str = option("1GiB", "KV-cache memory for every cache (16MiB, 1GiB...; vLLM "
                            "--kv-cache-memory-bytes): the same budget, so the smaller cache "
                            "holds more tokens.")
    max_model_len: int = option(2048, "vLLM max_model_len.", low=1)
    max_ttft_ms: float | None = option(None, "Target: p99 time to first token (ms).", low=0)
    max_tpot_ms: float | None = option(None, "Target: p99 time per output token (ms).", low=0)
    seed: int = option(0, "Seed of vLLM's random prompts (the same for every measurement).")
    enforce_eager: bool = option(False, "Serve without torch.compile: starts a minute or two "
                                 "sooner on a CPU, but measures the uncompiled model.",
                                 "--enforce-eager")
    vllm_python: str | None = vllm_python_option()
    timeout: float = option(1200, "Seconds to wait for each server to start.", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_budget(self.kv_budget)  # refused now, not after a server start
        if self.input_len + self.output_len > self.max_model_len:
            raise UsageError(f"--input-len + --output-len ({self.input_len + self.output_len})"
                             f" exceed --max-model-len {self.max_model_len}")
