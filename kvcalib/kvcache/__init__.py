"""The KV cache itself: its shape from config.json (geometry), every vLLM format as data
(formats), their bytes and what fits a budget (capacity, `kvcalib estimate`). The torch
parts, each format's math (quantize) and a simulated cache inside transformers
(simulate), are imported by their module names."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "Estimate": "capacity", "EstimateOptions": "capacity", "Kivi": "capacity",
    "estimate": "capacity", "from_config": "capacity", "parse_budget": "capacity",
    "FORMATS": "formats", "TARGETS": "formats", "KVFormat": "formats",
    "CacheShape": "geometry", "Geometry": "geometry"})
