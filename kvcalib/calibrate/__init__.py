"""Stage 2, `kvcalib run`: measure FP8 KV scales with llm-compressor and write the
checkpoint. run.calibrate is the entry point; its options come in four groups."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "CalibrationResult": "run", "calibrate": "run", "ComputeOptions": "options",
    "SampleOptions": "options", "ScaleOptions": "options", "WriteOptions": "options"})
