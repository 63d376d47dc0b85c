"""Stage 1, text: the built-in offline corpus and any dataset, chosen reproducibly."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "DEFAULT_DATASET": "datasets", "DatasetSpec": "datasets", "Samples": "datasets",
    "load_rows": "datasets", "select_samples": "datasets"})
