"""`kvcalib eval`: what an FP8 KV cache costs in accuracy, layer by layer, before release.

Everything runs in transformers with a simulated cache (kvcache.simulate) against an
exact reference run of the same model on the same tokens:
- configurations: the checkpoint's own scales (E4M3), scale 1.0 (what vLLM uses when
  scales are missing), E5M2 at scale 1.0, optionally another checkpoint's scales, and
  optionally 2-bit KIVI;
- metrics on held-out text: mean and p99 per-token KL(p_ref || p_fp8), top-1 agreement,
  perplexity and its relative change, the fraction of K/V (and Q) elements clipped;
- a passkey retrieval probe at several lengths and depths;
- a per-layer sweep (one layer quantized, and all but one), a ranking, and the smallest
  skip set (found greedily) that keeps KL within a budget;
- gates (--max-kl, --max-ppl-increase, --min-passkey) that set exit code 1;
- optionally every vLLM KV format (--formats, kvcache.formats) with its tokens at a
  memory budget (kvcache.capacity), each row's difference from calibrated FP8 with a
  paired 95% interval, a Pareto plot, and the highest-capacity format that meets the
  gates on a --target;
- optionally the real engine: vLLM prompt log-probs with fp8 against the model dtype
  (and for a weight-quantized checkpoint, the weights-only, KV-only and combined rows).
"""


from __future__ import annotations

import dataclasses
import math
import reprlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.checkpoint import layouts
from kvcalib.checkpoint.calibration_report import CalibrationReport
from kvcalib.checkpoint.read import Checkpoint, KvScales, open_checkpoint, scale_checks
from kvcalib.checkpoint.safetensors import file_tensors
from kvcalib.checkpoint.write import write_with_kv_scales
from kvcalib.checks import FAIL, WARN, Check
from kvcalib.data import DatasetSpec, Samples, corpus, select_samples
from kvcalib.engine.compare import compare_runs
from kvcalib.engine.interpreter import resolve_vllm_python
from kvcalib.engine.log import LogFacts
from kvcalib.engine.process import ProbeRequest, ProbeRun, log_folder, run_probe
from kvcalib.errors import KvcalibError, UsageError
from kvcalib.evaluate import format_comparison, separate
from kvcalib.evaluate.metrics import CALIBRATED, E5M2, SCALE_ONE, batches, score, verdict
from kvcalib.evaluate.options import EngineCheck, EvalOptions, HeldOut, SimulationOptions
from kvcalib.evaluate.passkey import passkey_trials, run_passkey
from kvcalib.evaluate.result import EvalResult, gate_checks
from kvcalib.evaluate.sweep import sweep
from kvcalib.kvcache import capacity, geometry, simulate
from kvcalib.text import Log, stderr


def load_model(ckpt: Checkpoint, dtype: str):
    """The checkpoint's model without its KV quantization (kvcache.simulate simulates it);
    quantized weights are decompressed to their quantized values (calibrate.weight_schemes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from kvcalib.calibrate import weight_schemes

    config = AutoConfig.from_pretrained(ckpt.folder)  # transformers' own config object
    weight_quant = weight_schemes.input_quantization(ckpt)
    if weight_quant is not None:
        config.quantization_config = {**weight_quant, "kv_cache_scheme": None}
    elif hasattr(config, "quantization_config"):
        del config.quantization_config
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the scale tensors are "unexpected keys": expected here
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt.folder, config=config,
                                                     dtype=getattr(torch, dtype),
                                                     **weight_schemes.load_options(weight_quant))
        tokenizer = AutoTokenizer.from_pretrained(ckpt.folder)
    except Exception as exc:  # transformers raises many types for unloadable models
        raise UsageError(f"cannot load {ckpt.folder}: {str(exc).splitlines()[0]}") from None
    finally:
        logging.set_verbosity(verbosity)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise UsageError(f"{ckpt.folder}: the tokenizer has {len(tokenizer)} tokens but the "
                         f"model's embedding only {vocab}: tokenizer and model do not match")
    simulate.install(model)
    return model.eval(), tokenizer


def load_scales(path: Path, like: Checkpoint, notes: list[str]) -> tuple[KvScales, str]:
    """Scales of another checkpoint of the same model in any layout verify reads, or a
    .safetensors file of scales, validated as `verify` validates a checkpoint's, and that
    checkpoint's layout. Whether vLLM would load that checkpoint (its scheme check) is
    not what eval compares; where its scales were measured goes to `notes`."""
    if path.is_file():
        checks, found = _scales_file(path, like)
    else:
        found, checks = open_checkpoint(path)
        if found.scheme is None:
            why = next((c.message for c in checks if c.status == FAIL), "")
            raise UsageError(f"--compare {path}: no KV scales to compare: {why}")
    notes += [f"--compare {path.name}: {c.message}" for c in checks
              if c.group == "measurement" and c.status == WARN]
    problems = [c.message for c in checks if c.status == FAIL and c.group != "scheme"]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UsageError(f"--compare {path}: its KV scales do not pass verify: "
                         f"{'; '.join(problems[:3])}{more}")
    mine, theirs = like.geometry, found.geometry
    if mine and theirs and (mine.attention_layers, mine.num_kv_heads) != (
            theirs.attention_layers, theirs.num_kv_heads):
        raise UsageError(f"--compare {path}: its scales are for another model shape "
                         f"({len(theirs.attention_layers)} attention layers, {theirs.num_kv_heads}"
                         f" KV heads; this model has {len(mine.attention_layers)} and "
                         f"{mine.num_kv_heads})")
    return found.scales, found.scheme.layout


def _scales_file(path: Path, like: Checkpoint) -> tuple[list[Check], Checkpoint]:
    """k/v(/q) scales named as in a checkpoint, checked against this model's shape; their
    strategy (per tensor or per head) is what the file holds."""
    if like.geometry is None:
        raise UsageError(f"--compare {path}: the checkpoint's own config is unreadable")
    scales, duplicates = layouts.find_scales(file_tensors(path.parent, path.name))
    per_head = any(math.prod(s.info.shape) > 1 for s in scales if s.kind != "q")
    scheme = layouts.KvScheme("scales file", strategy="attn_head" if per_head else "tensor",
                              quantizes_query=any(s.kind == "q" for s in scales))
    checks = [Check("scales", FAIL, f"{name}: a second scale for the same layer and kind")
              for name in duplicates]
    more, valid = scale_checks(scales, scheme, like.geometry)
    return checks + more, Checkpoint(path, geometry=like.geometry, scheme=scheme, scales=valid)


# ----- held-out text ----- #


def held_out_samples(report: CalibrationReport | None, tokenizer, held_out: HeldOut,
                     notes: list[str]) -> Samples:
    """Held-out text: the given dataset, else the built-in corpus; rows calibration used
    (from its report) are left out when it is the same dataset.

    The report is part of the checkpoint, so it is not trusted to choose what to read: its
    dataset is used only when it is the built-in corpus or the user names it (--dataset).
    """
    spec, calibrated_on = held_out.dataset, None
    if report is not None:
        ds = report.dataset
        calibrated_on = DatasetSpec(ds.source, ds.config, ds.split, ds.text_column)
    if spec is None:
        spec = DatasetSpec(corpus.NAME)
        if calibrated_on and calibrated_on.source != corpus.NAME:
            notes.append(f"calibration used dataset {reprlib.repr(calibrated_on.source)}; eval "
                         "reads it only when named with --dataset, so it used the built-in "
                         "corpus")
    exclude: set[int] = set()
    if report is not None and calibrated_on and spec.describe() == calibrated_on.describe():
        exclude = set(report.dataset.rows_used)
    samples = select_samples(spec, tokenizer, held_out.num_samples, held_out.max_seq_len,
                             held_out.seed, exclude_rows=exclude)
    samples.dataset["excluded_calibration_rows"] = len(exclude)
    return samples


def evaluate(ckpt: str | Path, options: EvalOptions = EvalOptions(),
             log: Log = stderr) -> EvalResult:
    """Simulate FP8 KV caches (and with `options.formats`, every vLLM KV format) on
    held-out text and compare them with an exact reference."""
    from tqdm import tqdm

    folder = Path(ckpt)
    if not folder.is_dir():
        raise UsageError(f"checkpoint folder not found: {folder}")
    opened, checks = open_checkpoint(folder)
    unreadable = [c.message for c in checks if c.status == FAIL
                  and c.group in ("config", "weights", "layers")]
    if unreadable:
        raise UsageError(f"cannot evaluate {folder}: {unreadable[0]}")
    report = opened.report  # validated before the slow model load
    notes: list[str] = []
    bad_scales = [c.message for c in checks if c.status == FAIL]
    own = {} if bad_scales else opened.scales.to_torch()
    if not own:
        why = f"its scales fail verify ({bad_scales[0]})" if bad_scales else "it has no KV scales"
        notes.append(f"the checkpoint's own scales are not evaluated: {why}; only the "
                     "scale-1.0 (E4M3) and E5M2 baselines are")
    kivi = options.simulation.kivi_cache
    if kivi and opened.geometry and opened.geometry.head_dim % kivi.group_size:
        raise UsageError(f"--kivi-group-size {kivi.group_size} must divide the head size "
                         f"{opened.geometry.head_dim}")
    held_out, sim_options = options.held_out, options.simulation
    reference = separate.find_reference(opened, sim_options.reference, notes)
    model, tokenizer = load_model(opened, sim_options.dtype)
    ref_model = (None if reference is None else
                 _reference_model(reference, (model, tokenizer), sim_options, notes))
    samples = held_out_samples(report, tokenizer, held_out, notes)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_list = list(batches(samples, held_out.batch_size, pad))
    sims, rows = _configurations(opened, own, options, notes)
    main_name = CALIBRATED if own else SCALE_ONE
    layers = opened.geometry.attention_layers if opened.geometry else []
    trials = _passkey_trials(model, tokenizer, options, notes)
    sweep_batches = (batch_list[:math.ceil(options.layer_sweep.samples / held_out.batch_size)]
                     if options.layer_sweep.sweep else [])
    passkey_sims = {main_name: simulate.Simulation(rounding=options.rounding, scales=own,
                                                   kinds=opened.kinds, count_clipping=False)}
    passkey_sims.update({row.metrics_key: sims[row.metrics_key] for row in rows
                         if row.metrics_key and row.metrics_key != main_name})
    steps = (len(batch_list) * (len(sims) + 4 * (ref_model is not None))
             + (1 + len(passkey_sims)) * len(trials)
             + len(sweep_batches) * (2 * len(layers) + 1))
    log(f"Evaluating {len(sims)} configurations on {len(samples.token_ids)} held-out samples "
        f"({samples.num_tokens} tokens), {sim_options.dtype}, rounding {options.rounding}")
    started = time.perf_counter()
    with tqdm(total=steps, desc="eval", file=sys.stderr, leave=False) as bar:
        ref_ppl, metrics = score(model, batch_list, sims, bar.update)
        passkey_result = None
        if trials:
            passkey_result = {"reference": run_passkey(model, tokenizer, trials, None,
                                                       bar.update)}
            passkey_result.update({name: run_passkey(model, tokenizer, trials, sim, bar.update)
                                   for name, sim in passkey_sims.items()})
        sweep_result = None
        if sweep_batches:
            sweep_result = sweep(model, sweep_batches, sims[main_name], layers,
                                 options.gates.max_kl, bar.update)
            sweep_result["samples"] = sum(len(tokens) for tokens, _ in sweep_batches)
        apart = None
        if reference is not None and ref_model is not None:
            apart = _weights_and_kv((model, ref_model), reference.folder, batch_list,
                                    (main_name, sims[main_name]), bar.update)
    kivi_info = None
    if kivi:
        kivi_info = {"name": _kivi_name(kivi), "group": kivi.group_size,
                     "residual": kivi.residual, "bytes_per_token": _kivi_bytes(
                         opened.config, kivi, max(map(len, samples.token_ids)))}
    result = EvalResult(
        checkpoint=str(opened.folder.resolve()),
        samples={**samples.dataset, "count": len(samples.token_ids), "tokens": samples.num_tokens,
                 "max_seq_len": held_out.max_seq_len, "dtype": sim_options.dtype,
                 "rounding": options.rounding,
                 "seconds": round(time.perf_counter() - started, 1)},
        reference_ppl=ref_ppl, metrics=metrics, notes=notes, passkey=passkey_result,
        sweep=sweep_result, kivi=kivi_info, separate=apart, verdict=verdict(metrics) if own else "",
        layer_scales=_layer_scales(opened))
    if rows:
        result.formats = format_comparison.compare(rows, result, main_name, options.gates,
                                                   options.formats)
    if options.engine.engine:
        result.engine = _engine_cross_check(opened, samples, options.engine, log,
                                            reference if apart is not None else None)
    result.checks = gate_checks(result, main_name, options.gates)
    return result


def _configurations(opened: Checkpoint, own: dict[int, dict[str, Any]], options: EvalOptions,
                    notes: list[str]
                    ) -> tuple[dict[str, simulate.Simulation], list[format_comparison.FormatRow]]:
    """Every simulated cache to score, by name: the checkpoint's own scales, scale 1.0 in
    E4M3 and E5M2, --compare, KIVI and the formats' rows. Queries are quantized only where
    the checkpoint says so (FP8 attention backends), then in every configuration alike."""
    kinds, rounding = opened.kinds, options.rounding

    def fp8(scales: dict[int, dict[str, Any]], fmt: str = "e4m3") -> simulate.Simulation:
        return simulate.Simulation(fmt=fmt, rounding=rounding, scales=scales, kinds=kinds)

    sims = {CALIBRATED: fp8(own)} if own else {}
    sims.update({SCALE_ONE: fp8({}), E5M2: fp8({}, "e5m2")})
    compare = options.simulation.compare
    if compare is not None:
        scales, layout = load_scales(Path(compare), opened, notes)
        sims[f"compare: {Path(compare).name} ({layout}, e4m3)"] = fp8(scales.to_torch())
    kivi = options.simulation.kivi_cache
    if kivi:
        sims[_kivi_name(kivi)] = simulate.Simulation(mode="kivi", kivi=kivi,
                                                     count_clipping=False)
    if not options.formats.names:
        return sims, []
    known = {("e4m3", "calibrated"): CALIBRATED, ("e4m3", "scale 1.0"): SCALE_ONE,
             ("e5m2", "scale 1.0"): E5M2}
    rows, more = format_comparison.plan_rows(opened, own, options, known)
    return {**sims, **more}, rows


def _reference_model(reference: Checkpoint, loaded: tuple[Any, Any],
                     sim_options: SimulationOptions, notes: list[str]) -> Any:
    """The unquantized model, loaded before any scoring; one that turns out to be another
    model is refused when the user gave it, and left out with a note (None) when the
    calibration report named it."""
    ref_model, ref_tokenizer = load_model(reference, sim_options.dtype)
    why = separate.same_model(ref_model, ref_tokenizer, *loaded)
    if why is None:
        return ref_model
    if sim_options.reference is not None:
        raise UsageError(f"--reference {reference.folder} is not this checkpoint's model: {why}")
    notes.append(f"no unquantized reference: the calibration report's input model "
                 f"{reference.folder} is not this checkpoint's model ({why}); "
                 f"{separate.NO_REFERENCE}")
    return None


def _weights_and_kv(models: tuple[Any, Any], reference: Path, batch_list: list[Any],
                    cache: tuple[str, simulate.Simulation],
                    progress: Callable[[], None]) -> dict[str, Any]:
    """Weights only, KV only and both against the unquantized model (evaluate.separate)."""
    model, ref_model = models
    cache_name, simulation = cache
    sims, runs = separate.configurations(
        model, ref_model, lambda: dataclasses.replace(simulation, clip_counts={}))
    ref_ppl, metrics = score(ref_model, batch_list, sims, progress, models=runs)
    return separate.summarize(reference, cache_name, ref_ppl, metrics)


def _kivi_name(kivi: capacity.Kivi) -> str:
    return f"kivi 2-bit (G={kivi.group_size}, R={kivi.residual})"


def _passkey_trials(model, tokenizer, options: EvalOptions, notes: list[str]
                    ) -> list[dict[str, Any]]:
    """The passkey prompts, without the lengths the model's context cannot hold."""
    lengths = options.passkey.lengths
    context = model.config.get_text_config().max_position_embeddings
    if any(length > context for length in lengths):
        notes.append(f"passkey lengths above the model's context ({context}) were left out")
        lengths = [length for length in lengths if length <= context]
    if not lengths:
        return []
    return passkey_trials(tokenizer, lengths, options.passkey.depths, options.held_out.seed)


def _kivi_bytes(config: dict[str, Any], kivi: capacity.Kivi, tokens: int) -> dict[str, Any]:
    """Real bytes per token of each format for requests as long as the eval's samples."""
    est = capacity.from_config(config, capacity.EstimateOptions(context_length=tokens,
                                                                kivi=kivi))
    per_token = {f.name: f.request_bytes / tokens for f in est.formats}
    kivi2 = next(f for f in est.formats if f.name == "kivi2")
    return {"tokens": tokens, "kivi": per_token["kivi2"], "fp8": per_token["fp8"],
            "16bit": per_token[est.dtype], "kivi_long_context": kivi2.bytes_per_token}


def _engine_cross_check(ckpt: Checkpoint, samples: Samples, options: EngineCheck,
                        log: Log, reference: Checkpoint | None) -> dict[str, Any]:
    """vLLM prompt log-probs on the same token ids, with fp8 and with the model dtype; with
    an unquantized `reference`, also the weights-only, KV-only and combined rows."""
    try:
        python, _ = resolve_vllm_python(options.vllm_python)
    except UsageError as exc:
        return {"error": str(exc)}
    log_dir = Path(options.log_dir or log_folder("eval", ckpt.folder))
    baseline = geometry.cache_dtype(ckpt.geometry and ckpt.geometry.dtype)

    def probe(folder: Path, dtype: str, name: str) -> ProbeRun:
        log_path = log_dir / f"vllm-{name}.log"
        log(f"Starting vLLM on {folder.name} with kv_cache_dtype={dtype}; log: {log_path}")
        ask = ProbeRequest(folder, dtype, max(map(len, samples.token_ids)) + 8,
                           prompts=samples.token_ids, max_tokens=1)
        return run_probe(python, ask, log_path)

    runs = {dtype: probe(ckpt.folder, dtype, dtype) for dtype in ("fp8", baseline)}
    fp8, base = runs["fp8"], runs[baseline]
    result = compare_runs(fp8, base)
    result["logs"] = {k: str(v.log_path) for k, v in runs.items()}
    if not fp8.started:
        result["error"] = fp8.result.get("error") or "vLLM did not start with fp8"
        if fp8.facts.hardware:
            result["error"] = ("vLLM on this machine cannot run an FP8 KV cache "
                               f"({fp8.facts.hardware})")
    if reference is not None:
        with tempfile.TemporaryDirectory(prefix="kvcalib-kv-only-") as tmp:
            view = Path(tmp) / f"{reference.folder.name}-with-kv-scales"
            view.mkdir()
            try:
                write_with_kv_scales(reference.folder, ckpt, view)
                kv_only = probe(view, "fp8", "kv-only")
            except KvcalibError as exc:  # a row of its own, not the whole eval
                kv_only = ProbeRun("fp8", {"started": False, "error": f"no KV-only "
                                           f"view: {exc}"}, log_dir / "vllm-kv-only.log",
                                   LogFacts(), 0.0)
        ref = probe(reference.folder, baseline, "reference")
        result["separate"] = separate.engine_rows(
            ref, {separate.WEIGHTS: base, separate.KV: kv_only, separate.BOTH: fp8})
        result["logs"].update({name: str(run.log_path) for name, run in
                               (("kv-only", kv_only), ("reference", ref))
                               if run.log_path.exists()})
    return result


def _layer_scales(ckpt: Checkpoint) -> dict[str, Any]:
    """Largest k/v scale per attention layer (None where missing), for plots."""
    layers = ckpt.geometry.attention_layers if ckpt.geometry else []
    scales: dict[str, Any] = {"layers": layers}
    for kind in ("k", "v"):
        scales[kind] = [float(np.max(scale.values)) if (scale := ckpt.scales.get(i, kind))
                        else None for i in layers]
    return scales


