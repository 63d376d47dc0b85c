"""A checkpoint's files: safetensors read without loading weights, the layouts each format
keeps its KV scales in, a checkpoint opened and checked once (read), written (write), its
calibration report, and the two commands that need nothing else: `convert` and `inspect`
(modules of those names)."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "Checkpoint": "read", "KvScales": "read", "Scale": "read", "open_checkpoint": "read",
    "open_model": "read", "REPORT_FILE": "calibration_report",
    "CalibrationReport": "calibration_report",
    "load_report": "calibration_report", "SCALES_FILE": "write", "write_checkpoint": "write"})
