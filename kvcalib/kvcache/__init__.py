"""The KV cache itself: its shape from config.json (geometry), every vLLM format as data
(formats), their bytes and what fits a budget (capacity, `kvcalib estimate`). The torch
parts, each format's math (quantize) and a simulated cache inside transformers
(simulate), are imported by their module names."""

from kvcalib.kvcache.capacity import (
    Estimate,
    EstimateOptions,
    Kivi,
    estimate,
    from_config,
    parse_budget,
)
from kvcalib.kvcache.formats import FORMATS, TARGETS, KVFormat
from kvcalib.kvcache.geometry import CacheShape, Geometry

__all__ = ["FORMATS", "TARGETS", "CacheShape", "Estimate", "EstimateOptions", "Geometry",
           "KVFormat", "Kivi",
           "estimate", "from_config", "parse_budget"]
