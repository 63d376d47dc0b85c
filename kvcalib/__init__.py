"""kvcalib: calibrate, verify and evaluate FP8 KV-cache scales for vLLM checkpoints.

The pipeline's stages are packages, each exporting its entry point and options:
kvcalib.data -> calibrate -> checkpoint -> verify -> evaluate -> report, over kvcache (the
cache's shape, formats and math), with a thin cli. Importing kvcalib loads none of them,
so that light commands (`verify --static-only`, `estimate`, `inspect`) start without torch.
"""

__version__ = "0.1.0"
