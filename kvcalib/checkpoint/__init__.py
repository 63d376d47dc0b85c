"""A checkpoint's files: safetensors read without loading weights, the layouts each format
keeps its KV scales in, a checkpoint opened and checked once (read), written (write), its
calibration report, and the two commands that need nothing else: `convert` and `inspect`
(modules of those names)."""

from kvcalib.checkpoint.read import Checkpoint, KvScales, Scale, open_checkpoint, open_model
from kvcalib.checkpoint.report_file import REPORT_FILE, CalibrationReport, load_report
from kvcalib.checkpoint.write import SCALES_FILE, write_checkpoint

__all__ = ["REPORT_FILE", "SCALES_FILE", "CalibrationReport", "Checkpoint", "KvScales",
           "Scale", "load_report", "open_checkpoint", "open_model", "write_checkpoint"]
