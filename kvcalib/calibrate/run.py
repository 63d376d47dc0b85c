"""Calibrate FP8 KV-cache scales with llm-compressor and write a release-ready checkpoint.

llm-compressor measures the scales (QuantizationModifier with a kv_cache_scheme). This
module chooses what it gets wrong by default and writes the output itself:

- observer: the true running absmax (`static_minmax`), not the EMA default, which
  measured up to 42% low on SmolLM2 and clips the largest keys and values;
- q_scale: llm-compressor 0.14.0.1 forces eager attention while calibrating, which
  bypasses compressed-tensors' hooked attention, so q is never observed and q_scale is
  saved as uninitialized memory. `oneshot.calibration_attention` keeps it hooked;
- attention: eager by default, as llm-compressor calibrates, so the scales are bit for bit
  its own. `sdpa` (basic pipeline) skips materializing the S x S scores; it gives the
  same scales in float32 and moves some by a few bf16 steps when computing in bf16;
- output: the input's weight files are copied, cloned or linked (kvcalib.checkpoint.write)
  and the scales are added in their own file, so every weight is bit-identical to the input;
- our own hooks record each sample's absmax of every K/V/Q tensor in float32, so each
  scale is checked against what was really seen before anything is written, and the
  report says when each scale stopped growing (kvcalib.calibrate.convergence);
- work: no logits are needed, so the basic pipeline stops each forward pass once the
  last attention layer's K and V (and Q) are seen: the rest of that layer, the final
  norm and lm_head never run;
- scale: under torchrun every rank calibrates its share of the samples
  (kvcalib.calibrate.distributed), and the pipeline is chosen, or the model refused, from the
  bytes it needs before it is loaded (kvcalib.calibrate.memory).
"""


from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvcalib.calibrate import convergence, distributed, oneshot, weight_schemes
from kvcalib.calibrate.options import ComputeOptions, SampleOptions, ScaleOptions, WriteOptions
from kvcalib.calibrate.preflight import load_model, load_tokenizer, preflight
from kvcalib.calibrate.summary import calibration_summary
from kvcalib.checkpoint.calibration_report import (
    REPORT_FILE,
    REPORT_SCHEMA_VERSION,
    CalibrationReport,
)
from kvcalib.checkpoint.safetensors import raw, tensor_index
from kvcalib.checkpoint.write import RECIPE_FILE, copy_side_files, write_checkpoint
from kvcalib.checks import Check, CommandResult
from kvcalib.data import select_samples
from kvcalib.dtypes import E4M3_MAX
from kvcalib.engine import targets as serving
from kvcalib.errors import CheckFailed
from kvcalib.reads import load_config
from kvcalib.text import Log, stderr
from kvcalib.writes import atomic_output_dir

# llm-compressor logs INFO lines and a CPU warning per stage; keep its errors only,
# unless the user asks for more.
os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")

# What the ranks wait for before the checkpoint appears (named if a rank is lost there).
WRITTEN = "rank 0 wrote the checkpoint"
# A measured absmax and its stored scale may differ by the rounding of the model dtype.
SCALE_RTOL = 2**-7


@dataclass
class CalibrationResult(CommandResult):
    """Where the checkpoint went and what was measured (the report it holds).

    Under torchrun every rank gets one; only rank 0 wrote the checkpoint.
    """

    checks: ClassVar[list[Check]] = []  # a failed calibration raises: exit code 0

    output: Path
    report: CalibrationReport
    rank: int = 0
    serving: list[serving.Verdict] = field(default_factory=list)  # the common targets

    def to_dict(self) -> dict[str, Any]:
        return self.report.model_dump(mode="json", exclude_unset=True)

    def summary(self) -> str:
        weights = self.report.weight_quantization
        weights_line = weight_schemes.weights_line(weights.model_dump() if weights else None)
        return "\n".join([calibration_summary(self.report),
                          f"Weights:    {weights_line}",
                          f"Checkpoint: {self.output}",
                          f"Report:     {self.output / REPORT_FILE}",
                          *([serving.serving_table(self.serving)] if self.serving else [])])


def calibrate(model: str | Path, output: str | Path, *, scales: ScaleOptions = ScaleOptions(),
              samples: SampleOptions = SampleOptions(), compute: ComputeOptions = ComputeOptions(),
              writing: WriteOptions = WriteOptions(), log: Log = stderr) -> CalibrationResult:
    """Measure FP8 KV scales of `model` on `samples` and write `output` atomically.

    With `scales.scheme` (a compressed-tensors preset) the weights are quantized in the same
    pass and written compressed; without it the input's weight files are copied bit for
    bit. Under torchrun each rank calibrates its share of the samples; rank 0 alone writes,
    and every rank returns the same report once the checkpoint is in place.
    """
    started = time.perf_counter()
    with distributed.joined() as ranks:
        if not ranks.writer:
            log = _silent  # rank 0 speaks for the job
        checked = preflight(model, output, scales, samples, compute, writing, ranks)
        source, settings, plan = checked.source, checked.compute, checked.memory
        model_dir, config = source.folder, source.config
        input_quant = checked.input_quantization
        log(f"Loading {model_dir}" + (f" on {ranks.world_size} ranks ({ranks.backend})"
                                      if ranks.world_size > 1 else ""))
        tokenizer = load_tokenizer(model_dir)
        chosen = select_samples(samples.dataset, tokenizer, samples.num_samples,
                                samples.max_seq_len, samples.seed)
        used = len(chosen.token_ids)
        if used < samples.num_samples:
            log(f"Only {used} usable samples in {samples.dataset.source} "
                f"(asked for {samples.num_samples}); calibrating on those.")
        shares = distributed.shares(used, ranks.world_size)
        if ranks.world_size > 1 and scales.observer != "static_minmax":
            log(f"Warning: llm-compressor averages {scales.observer} statistics over the ranks, "
                f"so the scales depend on the number of ranks ({ranks.world_size}); "
                "static_minmax takes their maximum and does not")
        attention = compute.attention
        if attention == "sdpa" and plan.pipeline == "sequential":
            log("The sequential pipeline traces under eager attention: calibrating with "
                "eager, not sdpa")
            attention = "eager"
        settings = {**settings, "attention": attention}
        torch_model = load_model(model_dir, settings["dtype"],
                                 plan.device if plan.pipeline == "basic" else "cpu",
                                 weight_schemes.load_options(input_quant), attention)
        modules = oneshot.attention_modules(torch_model, config)
        if scales.scheme is not None:
            weight_schemes.check_fits(torch_model, scales.scheme)
        load_s = time.perf_counter() - started

        log(f"Calibrating {len(modules)} attention layers on {used} samples "
            f"({chosen.num_tokens} tokens), strategy {scales.strategy}, observer "
            f"{scales.observer}, pipeline {plan.pipeline} ({plan.reason}), {attention} "
            f"attention, {settings['dtype']} on {settings['device']}")
        targets = oneshot.attention_classes(modules) if scales.q_scale else None
        modifier = oneshot.build_modifier(scales, targets)
        t0 = time.perf_counter()
        mine = [chosen.token_ids[i] for i in shares[ranks.rank]]
        recorder = oneshot.run_oneshot(torch_model, tokenizer, modifier, mine, plan.pipeline,
                                       modules, scales.q_scale,
                                       whole_model=scales.scheme is not None)
        per_sample = _gather(recorder.per_sample(), ranks)
        calibrate_s = time.perf_counter() - t0

        measured = oneshot.scale_tensors(modules, scales.kinds, settings["checkpoint_dtype"])
        layers = _collect_scales(measured, per_sample, scales.observer)
        flagged = convergence.flagged(layers, scales.kinds)
        if flagged:
            log(convergence.late_growth(flagged, len(layers) * len(scales.kinds), used))
        quant_config = oneshot.quantization_config(torch_model,
                                                   compressed=scales.scheme is not None)
        if input_quant is not None:
            quant_config = weight_schemes.with_kv_scheme(input_quant, quant_config, targets)
        report = {
            "schema_version": REPORT_SCHEMA_VERSION,
            "kvcalib_version": metadata.version("kvcalib"),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "model": {"source": str(model), "path": str(model_dir),
                      "architecture": (config.get("architectures") or ["?"])[0],
                      "model_type": config.get("model_type")},
            "scheme": {"num_bits": 8, "type": "float", "format": "float8_e4m3fn",
                       "fp8_max": E4M3_MAX, "strategy": scales.strategy,
                       "q_scale": scales.q_scale, "observer": scales.observer},
            "dataset": {**chosen.dataset, "rows_used": chosen.rows},
            "samples": {"requested": samples.num_samples, "used": used,
                        "max_seq_len": samples.max_seq_len, "num_tokens": chosen.num_tokens,
                        "seed": samples.seed},
            "pipeline": {"requested": compute.pipeline, "used": plan.pipeline,
                         "reason": plan.reason},
            "compute": settings,
            "distributed": distributed.summary(ranks, shares, chosen.rows),
            "memory": {"weights": plan.need.weights, "activations": plan.need.activations,
                       "needed": plan.needed, "free": plan.free.device,
                       "capped": plan.free.capped},
            "weights": {"requested": writing.weights, "used": checked.placement[0],
                        "reason": checked.placement[1]},
            "weight_quantization": None if scales.scheme is None and input_quant is None else
            weight_schemes.report(quant_config, "run" if scales.scheme else "input",
                                  scales.scheme),
            "convergence": {"late_growth_threshold": convergence.LATE_GROWTH,
                            "flagged": flagged, "note": convergence.FLAG_NOTE},
            "versions": _versions(),
            "timings_s": {"load": round(load_s, 3), "calibrate": round(calibrate_s, 3)},
            "layers": layers,
        }
        if not ranks.writer:
            distributed.barrier(ranks, WRITTEN)
            return CalibrationResult(checked.target, CalibrationReport.model_validate(report),
                                     ranks.rank)
        t0 = time.perf_counter()
        log(f"Writing {checked.target}")
        with atomic_output_dir(checked.target, writing.overwrite) as tmp:
            if scales.scheme is None:
                write_checkpoint(tmp, source, {name: raw(tensor) for name, tensor in
                                               measured.items()},
                                 quant_config, weights=checked.placement[0])
            else:
                written = _write_quantized(tmp, model_dir, torch_model, measured,
                                           settings["checkpoint_dtype"])
                report["weight_quantization"] = weight_schemes.report(written, "run",
                                                                      scales.scheme)
            (tmp / RECIPE_FILE).write_text(oneshot.recipe_yaml(modifier))
            report["timings_s"]["save"] = round(time.perf_counter() - t0, 3)
            report["timings_s"]["total"] = round(time.perf_counter() - started, 3)
            built = CalibrationReport.model_validate(report)
            write_report(tmp, built)
            # The checkpoint appears only once every rank is still there.
            distributed.barrier(ranks, WRITTEN)
    written_traits = serving.traits(config, list(source.tensors), "compressed-tensors",
                                    scales.strategy, scales.q_scale)
    return CalibrationResult(checked.target, built, ranks.rank,
                             serving.where_it_serves(written_traits, serving.targets(None)))


def write_report(folder: Path, report: CalibrationReport) -> None:
    """kvcalib_report.json as it was built: fields never given (q scales of a k/v-only run)
    are left out, not written as null."""
    text = json.dumps(report.model_dump(mode="json", exclude_unset=True), indent=1)
    (folder / REPORT_FILE).write_text(text + "\n")


def _silent(_message: str) -> None:
    pass


def _gather(per_sample: dict[tuple[str, str], np.ndarray], ranks: distributed.Ranks,
            ) -> dict[tuple[str, str], np.ndarray]:
    """Every rank's per-sample absmax, in the order of the whole sample list."""
    gathered = distributed.all_gather(per_sample, ranks, "gathering the absmax seen")
    return {key: np.concatenate([part[key] for part in gathered]) for key in per_sample}


def _collect_scales(scales: dict[str, Any], per_sample: dict[tuple[str, str], np.ndarray],
                    observer: str) -> list[dict[str, Any]]:
    """Per-layer scales, absmax and convergence; refuse scales that are non-finite, <= 0
    or, for the running-absmax observer, different from the absmax our own hooks saw."""
    import torch

    layers: dict[str, dict[str, Any]] = {}
    for tensor_name, tensor in scales.items():
        name, kind = tensor_name.rsplit(".", 1)[0], tensor_name[-len("k_scale"):][0]
        scale = tensor.float().flatten()
        seen = torch.from_numpy(per_sample[(name, kind)].max(axis=0))
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise CheckFailed(f"{tensor_name} came out {scale.tolist()}: not finite and "
                              "positive; nothing was saved")
        if bool((seen == 0).any()):
            raise CheckFailed(f"{tensor_name}: every {kind} value seen was 0 (absmax per head "
                              f"{seen.tolist()}), so no scale can be measured; nothing was saved")
        expected = (seen if scale.numel() > 1 else seen.max().reshape(1)) / E4M3_MAX
        if observer == "static_minmax" and not torch.allclose(scale, expected, rtol=SCALE_RTOL):
            raise CheckFailed(f"{tensor_name} is {scale.tolist()}, but the absmax seen gives "
                              f"{expected.tolist()}; nothing was saved")
        entry = layers.setdefault(name, {"layer": oneshot.layer_index(name), "module": name})
        entry[f"{kind}_scale"] = scale.tolist()
        entry[f"{kind}_absmax"] = seen.tolist()
        entry[f"{kind}_convergence"] = convergence.per_scale(per_sample[(name, kind)],
                                                             per_head=scale.numel() > 1)
    return sorted(layers.values(), key=lambda e: e["layer"])


def _write_quantized(out: Path, model_dir: Path, model, scales: dict[str, Any],
                     dtype: str) -> dict[str, Any]:
    """Save a model whose weights this run quantized (`run --scheme`), compressed by
    compressed-tensors, in the input's dtype; return the quantization_config it wrote.

    The KV scales are saved with the model; each must be the one measured.
    """
    import torch
    from safetensors import safe_open

    model.to(getattr(torch, dtype))
    model.save_pretrained(out, save_compressed=True)
    copy_side_files(out, model_dir)  # the input's tokenizer and generation config
    saved_tensors = tensor_index(out)
    for name, expected in scales.items():
        with safe_open(saved_tensors[name].file, "pt") as saved:
            if not torch.equal(saved.get_tensor(name), expected):
                raise CheckFailed(f"{name}: the saved scale is not the one measured; "
                                  "nothing was saved")
    return load_config(out)["quantization_config"]


def _versions() -> dict[str, str]:
    packages = ("kvcalib", "llmcompressor", "compressed-tensors", "transformers", "torch",
                "datasets")
    versions = {}
    for package in packages:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    versions["python"] = sys.version.split()[0]
    return versions
