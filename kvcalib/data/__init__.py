"""Stage 1, text: the built-in offline corpus and any dataset, chosen reproducibly."""

from kvcalib.data import corpus
from kvcalib.data.datasets import DEFAULT_DATASET, DatasetSpec, Samples, load_rows, select_samples

__all__ = ["DEFAULT_DATASET", "DatasetSpec", "Samples", "corpus", "load_rows", "select_samples"]
