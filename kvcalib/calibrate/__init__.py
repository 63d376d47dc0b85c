"""Stage 2, `kvcalib run`: measure FP8 KV scales with llm-compressor and write the
checkpoint. run.calibrate is the entry point; its options come in four groups."""

from kvcalib.calibrate.options import ComputeOptions, SampleOptions, ScaleOptions, WriteOptions
from kvcalib.calibrate.run import CalibrationResult, calibrate

__all__ = ["CalibrationResult", "ComputeOptions", "SampleOptions", "ScaleOptions",
           "WriteOptions", "calibrate"]
