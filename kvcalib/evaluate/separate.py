"""Weight and KV quantization apart, then together, against the unquantized model.

A weight-quantized checkpoint with FP8 KV scales has two error sources in one network,
and eval's own reference (the checkpoint's weights with a 16-bit cache) hides the first.
So, with the unquantized model it was made from as the reference (exact weights, 16-bit
cache), on the same held-out tokens:
- weights only: the checkpoint's weights (as eval loads them: decompressed to their
  quantized values, activations quantized as their scheme says), 16-bit cache;
- KV only: the unquantized weights with the checkpoint's KV scales (simulated cache);
- both: the checkpoint's weights with its KV scales.
Whether the combination's KL is more than the sum of the two separate ones is a paired
bootstrap over the samples (kvcalib.stats), as every comparison eval prints.

The reference is `--reference`, else the calibration report's input model when that
folder still exists, is unquantized and is the same model (architecture, parameter
shapes, tokenizer); without one eval says so in a note and leaves the rows out.

With `--engine` the same three rows are also measured in vLLM (engine_rows): the
reference and the checkpoint with the model-dtype cache, the checkpoint with its FP8
cache, and the unquantized weights carrying the checkpoint's scales
(checkpoint.write.write_with_kv_scales) with an FP8 cache, each scoring the same token ids.
vLLM gives the log-prob of each prompt token and the top-1 token, not whole
distributions, so its rows have perplexity, top-1 agreement and mean |Δ log-prob| against
the reference run instead of KL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvcalib import stats
from kvcalib.checkpoint.read import Checkpoint, open_model
from kvcalib.engine.compare import logprob_agreement
from kvcalib.engine.process import ProbeRun
from kvcalib.errors import KvcalibError, UsageError
from kvcalib.evaluate.metrics import Metrics, compare_to, difference

REFERENCE = "reference (unquantized weights, 16-bit cache)"
WEIGHTS = "weights only (16-bit cache)"
KV = "KV only (unquantized weights, FP8 cache)"
BOTH = "both (quantized weights, FP8 cache)"
NO_REFERENCE = ("the weights-only, KV-only and combined rows need the unquantized model it "
                "was made from: pass --reference FOLDER")


def weight_quantized(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint's weights are quantized (KV-only quantization is not)."""
    from kvcalib.calibrate import weight_schemes

    return weight_schemes.input_quantization(ckpt) is not None


def find_reference(ckpt: Checkpoint, given: Path | None, notes: list[str]) -> Checkpoint | None:
    """The unquantized model to hold the checkpoint against, checked as far as its config
    tells (the rest once loaded: same_model). `--reference` that does not fit is a usage
    error; the report's input model that does not is a note, as is having none."""
    if not weight_quantized(ckpt):
        if given is not None:
            raise UsageError(f"--reference is for weight-quantized checkpoints; {ckpt.folder} "
                             "has unquantized weights (its own reference run is exact)")
        return None
    if given is not None:
        return _checked(ckpt, Path(given), "--reference")
    report = ckpt.report
    if report is None:
        notes.append(f"{ckpt.folder.name} has quantized weights and no calibration report "
                     f"naming the model they came from; {NO_REFERENCE}")
        return None
    if report.weight_quantization and report.weight_quantization.quantized_by == "input":
        notes.append(f"{ckpt.folder.name}'s weights were already quantized in its input "
                     f"({report.model.path}), so it has no unquantized reference; "
                     f"{NO_REFERENCE}")
        return None
    try:
        found = _checked(ckpt, Path(report.model.path), "the calibration report's input model")
    except KvcalibError as exc:
        notes.append(f"no unquantized reference: {exc}; {NO_REFERENCE}")
        return None
    notes.append(f"weights and KV apart: the reference is the calibration report's input "
                 f"model, {found.folder}")
    return found


def calibrated_from(folder: Path) -> Path | None:
    """The unquantized input model the calibration report of `folder` names when `run`
    quantized the weights: find_reference's reference when none is given, so an input
    that outputs must stay out of. None otherwise, or without a readable report
    (evaluate says why later)."""
    from kvcalib.checkpoint.calibration_report import load_report

    try:
        report = load_report(folder)
    except KvcalibError:
        return None
    quantized = report and report.weight_quantization
    return Path(report.model.path) if quantized and quantized.quantized_by == "run" else None


def _checked(ckpt: Checkpoint, folder: Path, what: str) -> Checkpoint:
    """The reference's config, refused when it is quantized or another architecture."""
    from kvcalib.calibrate import weight_schemes

    if not folder.is_dir():
        raise UsageError(f"{what} {folder} is not a folder")
    try:
        found = open_model(folder)
    except KvcalibError as exc:
        raise UsageError(f"{what} {folder}: {exc}") from None
    assert found.config is not None and ckpt.config is not None
    if weight_schemes.input_quantization(found) is not None:
        raise UsageError(f"{what} {folder} has quantized weights; the reference must be the "
                         "unquantized model")
    keys = ("architectures", "model_type", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size")
    differ = [f"{key} {found.config.get(key)!r} vs {ckpt.config.get(key)!r}" for key in keys
              if found.config.get(key) != ckpt.config.get(key)]
    if differ:
        raise UsageError(f"{what} {folder} is another model than {ckpt.folder.name}: "
                         f"{', '.join(differ)}")
    return found


def same_model(reference, reference_tokenizer, model, tokenizer) -> str | None:
    """Why the loaded reference is not the checkpoint's model unquantized (parameter
    names and shapes, tokenizer vocabulary), or None. The checkpoint's extra quantization
    parameters (weight_scale...) are not the reference's to have."""
    mine = {name: tuple(p.shape) for name, p in model.named_parameters()}
    theirs = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    missing = sorted(set(theirs) - set(mine))
    if missing:
        return f"the checkpoint has no parameter {missing[0]} ({len(missing)} missing)"
    shapes = [name for name, shape in theirs.items() if mine[name] != shape]
    if shapes:
        name = shapes[0]
        return (f"{len(shapes)} parameters differ in shape, e.g. {name} {list(theirs[name])} "
                f"vs {list(mine[name])}")
    if reference_tokenizer.get_vocab() != tokenizer.get_vocab():
        return "its tokenizer's vocabulary differs from the checkpoint's"
    return None


def configurations(model, reference, fp8) -> tuple[dict[str, Any], dict[str, Any]]:
    """The four runs, by name: simulations (None: 16-bit cache) and the model each runs
    (metrics.score's `models`); `fp8()` makes a fresh simulation of the checkpoint's cache
    (each run counts its own clipping)."""
    sims = {REFERENCE: None, WEIGHTS: None, KV: fp8(), BOTH: fp8()}
    models = {REFERENCE: reference, WEIGHTS: model, KV: reference, BOTH: model}
    return sims, models


def summarize(reference: Path, cache: str, reference_ppl: float,
              metrics: dict[str, Metrics]) -> dict[str, Any]:
    """The rows against the reference (mean KL and perplexity with paired 95% intervals)
    and whether the errors add up, more or less."""
    base = metrics[REFERENCE]
    rows = {name: {"metrics": metrics[name], "vs_reference": compare_to(base, metrics[name])}
            for name in (WEIGHTS, KV, BOTH)}
    found = interaction(metrics[WEIGHTS], metrics[KV], metrics[BOTH])
    return {"reference": str(reference.resolve()), "fp8_cache": cache,
            "reference_ppl": reference_ppl, "rows": rows,
            "interaction": difference(found) if found else None,
            "verdict": _verdict(metrics, found)}


def interaction(weights: Metrics, kv: Metrics, both: Metrics) -> stats.Comparison | None:
    """Mean KL of both minus (weights only + KV only), paired over the samples; None with
    too few samples. All three are scored on the same tokens, so per sample the sum of
    the separate summed KLs over the same token count is the sum of their means."""
    if stats.too_few(len(both.kl_by_sample)):
        return None
    added = weights.kl_pairs().copy()
    added[:, 0] += kv.kl_pairs()[:, 0]
    assert np.array_equal(added[:, 1], both.kl_pairs()[:, 1])
    return stats.paired_bootstrap(added, both.kl_pairs(), stats.ratio_of_sums)


def _verdict(metrics: dict[str, Metrics], found: stats.Comparison | None) -> str:
    w, kv, both = (metrics[name].mean_kl for name in (WEIGHTS, KV, BOTH))
    numbers = f"mean KL {both:.4g} combined vs {w:.4g} + {kv:.4g} = {w + kv:.4g} separately"
    if found is None:
        why = stats.too_few(len(metrics[BOTH].kl_by_sample))
        return f"{numbers}; {why} samples: use --num-samples {stats.MIN_SAMPLES} or more to tell"
    d = found.difference
    interval = (f"95% interval of combined minus sum {d.low:.3g} to {d.high:.3g} over "
                f"{found.samples} samples")
    if found.within_noise:
        return f"the errors add up (combined = sum within noise): {numbers} ({interval})"
    more = "more" if d.estimate > 0 else "less"
    how = "they compound" if more == "more" else "they partly cancel"
    return f"the combination costs {more} than the sum ({how}): {numbers} ({interval})"


def engine_rows(reference: ProbeRun, runs: dict[str, ProbeRun]) -> dict[str, Any]:
    """WEIGHTS, KV and BOTH in vLLM against the reference run, on the same prompts: per
    row its perplexity, its change with a paired 95% interval, top-1 agreement and mean
    |Δ log-prob| per token; then whether the per-token NLL changes add up. A row that did
    not run has its reason instead."""
    if not reference.started or not reference.result.get("outputs"):
        return {"error": f"the reference did not run: {_why(reference)}"}
    base = _nll_pairs(reference)
    ref_ppl = float(stats.perplexity(base[None])[0])
    rows: dict[str, Any] = {}
    pairs: dict[str, np.ndarray] = {}
    checkpoint_scales = _loaded_scales(runs[BOTH]) if runs[BOTH].started else None
    for name, run in runs.items():
        if not run.started or not run.result.get("outputs"):
            rows[name] = {"kv_cache_dtype": run.kv_cache_dtype, "error": _why(run)}
            continue
        if name == KV and checkpoint_scales is not None and \
                _loaded_scales(run) != checkpoint_scales:
            # compressed-tensors loads missing KV scales as 1.0 without a word
            rows[name] = {"kv_cache_dtype": run.kv_cache_dtype,
                          "error": "vLLM ran the KV-only view with other scales than the "
                                   "checkpoint's (read back from its attention layers)"}
            continue
        pairs[name] = _nll_pairs(run)
        ppl = float(stats.perplexity(pairs[name][None])[0])
        _, agree, diff = logprob_agreement(reference.result["outputs"], run.result["outputs"])
        rows[name] = {"kv_cache_dtype": run.kv_cache_dtype, "ppl": ppl,
                      "ppl_change": ppl / ref_ppl - 1, "top1_agreement": agree,
                      "mean_abs_logprob_diff": diff, "loaded_scales": _loaded_scales(run),
                      "vs_reference": None if stats.too_few(len(base)) else {
                          "ppl": difference(stats.paired_bootstrap(base, pairs[name],
                                                                   stats.perplexity))}}
    result: dict[str, Any] = {"reference": {"kv_cache_dtype": reference.kv_cache_dtype,
                                            "ppl": ref_ppl}, "rows": rows}
    if len(pairs) == 3 and not stats.too_few(len(base)):
        # Summed NLL per sample: (weights - ref) + (kv - ref) against (both - ref).
        added = pairs[WEIGHTS].copy()
        added[:, 0] += pairs[KV][:, 0] - base[:, 0]
        result["interaction"] = difference(stats.paired_bootstrap(added, pairs[BOTH],
                                                                  stats.ratio_of_sums))
    return result


def _why(run: ProbeRun) -> str:
    return (run.facts.hardware or run.facts.root_cause or run.result.get("error")
            or "vLLM gave no outputs")


def _loaded_scales(run: ProbeRun) -> dict[str, list[float | None]]:
    """The k and v scales each attention layer of vLLM ran with (the probe reads them
    back), by layer name."""
    return {layer: [entry.get("k_float"), entry.get("v_float")]
            for layer, entry in (run.result.get("scales") or {}).items()}


def _nll_pairs(run: ProbeRun) -> np.ndarray:
    """(summed negative log-prob, tokens) per prompt, from vLLM's prompt log-probs."""
    return np.array([(-sum(lp for _, lp, _ in out["prompt_logprobs"]),
                      len(out["prompt_logprobs"])) for out in run.result["outputs"]], dtype=float)
