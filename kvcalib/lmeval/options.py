"""What `kvcalib lm-eval` scores and how it starts vLLM, as a typed group checked once."""

from __future__ import annotations

from dataclasses import dataclass

from kvcalib.choices import OptionGroup, option
from kvcalib.engine.interpreter import vllm_python_option
from kvcalib.errors import UsageError

OFFLINE_NIAH = ["niah_single_1", "niah_multikey_2", "niah_multikey_3"]
# RULER tasks whose data are generated per context length (lm_eval/tasks/ruler/).
RULER = {*OFFLINE_NIAH, "niah_single_2", "niah_single_3", "niah_multikey_1",
         "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe",
         "ruler_qa_squad", "ruler_qa_hotpot"}
AUTO, SCALE_ONE, FP8 = "auto", "fp8-scale-one", "fp8"
CONFIGS = {AUTO: "auto", SCALE_ONE: "fp8", FP8: "fp8"}  # name -> vLLM kv_cache_dtype


@dataclass(frozen=True)
class LmEvalOptions(OptionGroup):
    """The tasks, lengths and configurations, the recovery gate, and how vLLM starts."""

    tasks: list[str] = option(OFFLINE_NIAH, "lm-eval tasks, comma separated (RULER tasks "
                              "run at every --lengths).", comma=str)
    lengths: list[int] = option([1024], "Context lengths (tokens) of the RULER tasks, "
                                "comma separated.", comma=int, low=256)
    limit: int = option(20, "Examples per task and length.", low=1)
    configs: list[str] = option(list(CONFIGS), "Configurations: auto (model-dtype cache), "
                                "fp8-scale-one (FP8 without the checkpoint's scales), fp8 "
                                "(with them); comma separated.", comma=str)
    min_recovery: float = option(0.95, "Fail (exit 1) when FP8 with the checkpoint's scales "
                                 "keeps less than this fraction of auto's accuracy.",
                                 low=0, high=10)
    max_model_len: int | None = option(None, "vLLM max_model_len (default: the largest "
                                       "--lengths).", low=1)
    vllm_python: str | None = vllm_python_option()
    timeout: float = option(3600, "Seconds each configuration may take.", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise UsageError(f"unknown --configs {', '.join(unknown) or '(none)'}; choose "
                             f"from {', '.join(CONFIGS)}")
        if not self.tasks:
            raise UsageError("--tasks names no task")
        if self.max_model_len is not None and self.max_model_len < max(self.lengths):
            raise UsageError(f"--max-model-len {self.max_model_len} is below the longest "
                             f"--lengths {max(self.lengths)}")
