"""Stage `kvcalib bench`: latency, throughput and useful concurrency of the FP8 KV cache
against the model-dtype cache, measured by vLLM's own `bench serve` (run.bench)."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "BenchOptions": "options", "BenchResult": "result", "CacheRun": "result", "bench": "run"})
