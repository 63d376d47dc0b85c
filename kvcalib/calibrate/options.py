"""`kvcalib run`'s options as four typed groups, each checked once, when it is built (by the
CLI, or by a Python caller): what to measure, on which text, how to compute, how to write.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcalib.choices import (
    MAX_SEQ_LEN,
    Attention,
    ComputeDtype,
    Observer,
    OptionGroup,
    Pipeline,
    Strategy,
    WeightsMode,
    option,
)
from kvcalib.data import DatasetSpec
from kvcalib.errors import UsageError
from kvcalib.writes import OVERWRITE_HELP


@dataclass(frozen=True)
class ScaleOptions(OptionGroup):
    """Which scales to measure, and (with `scheme`) which weights to quantize with them."""

    strategy: Strategy = option("tensor", "Scale granularity: tensor (one per layer; every "
                                "vLLM backend) or attn_head (one per KV head).")
    q_scale: bool = option(False, "Also calibrate q_scale, for FP8 attention backends.",
                           "--q-scale")
    observer: Observer = option("static_minmax", "static_minmax (true running absmax), "
                                "minmax (llm-compressor's EMA default, clips) or mse.")
    scheme: str | None = option(None, "Also quantize the weights in the same pass with this "
                                "compressed-tensors preset (FP8_DYNAMIC, FP8, W8A8, W4A16...; "
                                "lm_head is left out) and save them compressed. Without it, "
                                "the input's weights (unquantized or already quantized) are "
                                "copied bit for bit.")

    def __post_init__(self) -> None:
        from kvcalib.calibrate.weight_schemes import check_preset

        super().__post_init__()
        check_preset(self.scheme)

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("k", "v", "q") if self.q_scale else ("k", "v")


@dataclass(frozen=True)
class SampleOptions(OptionGroup):
    """The calibration text: which dataset, how many samples of how many tokens."""

    dataset: DatasetSpec = DatasetSpec()
    num_samples: int = option(512, "Calibration samples.", low=1)
    max_seq_len: int = option(2048, "Tokens per sample (truncated).", low=1,
                              high=MAX_SEQ_LEN)
    seed: int = option(0, "Seed for choosing the samples.", low=0)


@dataclass(frozen=True)
class ComputeOptions(OptionGroup):
    """How the calibration pass runs."""

    pipeline: Pipeline = option("auto", "auto (basic when the model fits the device, else "
                                "sequential), basic or sequential.")
    dtype: ComputeDtype = option("auto", "Compute dtype: auto (the checkpoint's, or float32 on "
                                 "CPUs without native bf16), bfloat16, float16 or float32.")
    attention: Attention = option("eager", "Attention while calibrating: eager (as "
                                  "llm-compressor calibrates: its scales bit for bit) or sdpa "
                                  "(faster, basic pipeline; same scales in float32, a few "
                                  "bf16 steps apart in bf16, see docs/run.md).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention == "sdpa" and self.pipeline == "sequential":
            raise UsageError("--attention sdpa needs the basic pipeline: llm-compressor's "
                             "sequential pipeline traces each layer under eager attention")


@dataclass(frozen=True)
class WriteOptions(OptionGroup):
    """How the checkpoint is written."""

    weights: WeightsMode = option("auto", "How the output gets the input's weight files: auto "
                                  "(reflink where the filesystem clones, else copy), copy, "
                                  "reflink (copy-on-write clone), or link (hard links: editing "
                                  "the input files in place would change the output).")
    overwrite: bool = option(False, OVERWRITE_HELP, "--overwrite")
