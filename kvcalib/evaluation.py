"""`kvcalib eval`: what an FP8 KV cache costs in accuracy, layer by layer, before release.

Everything runs in transformers with a simulated cache (kvcalib.quantsim) against an
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
- optionally the real engine: vLLM prompt log-probs with fp8 against the model dtype.
"""

from __future__ import annotations

import math
import random
import reprlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib import checkpoint, corpus, data, engine, layouts, quantsim, stats
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, WARN, Check, exit_code
from kvcalib.errors import UsageError
from kvcalib.schema import CalibrationReport, load_report
from kvcalib.verification import StaticScales, scale_checks, static_checks

CALIBRATED, SCALE_ONE, E5M2 = "calibrated (e4m3)", "scale 1.0 (e4m3)", "scale 1.0 (e5m2)"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class Metrics:
    mean_kl: float
    p99_kl: float
    top1: float
    ppl: float
    ppl_change: float  # relative to the reference perplexity
    clipped: dict[str, float] = field(default_factory=dict)  # fraction of elements, by k/v/q
    # Per held-out sample: summed token KL and token count. mean_kl is their ratio of sums;
    # the bootstrap resamples these pairs (kvcalib.stats).
    kl_by_sample: list[tuple[float, int]] = field(default_factory=list)
    mean_kl_ci: tuple[float, float] | None = None  # 95% bootstrap interval; None: 1 sample

    def kl_pairs(self) -> np.ndarray:
        return np.array(self.kl_by_sample, dtype=float).reshape(-1, 2)


@dataclass
class EvalResult:
    checkpoint: str
    samples: dict[str, Any]
    reference_ppl: float
    metrics: dict[str, Metrics]
    notes: list[str] = field(default_factory=list)
    verdict: str = ""
    passkey: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    kivi: dict[str, Any] | None = None
    layer_scales: dict[str, Any] = field(default_factory=dict)  # layers, largest k/v scale
    checks: list[Check] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def to_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["exit_code"] = self.exit_code
        return result


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----- loading ----- #


def load_model(ckpt: Path, dtype: str):
    """The checkpoint's model without its KV quantization (quantsim simulates it);
    quantized weights are decompressed to their quantized values (kvcalib.weight_schemes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from kvcalib import weight_schemes

    config = AutoConfig.from_pretrained(ckpt)
    weight_quant = weight_schemes.input_quantization(ckpt, checkpoint.load_config(ckpt))
    if weight_quant is not None:
        config.quantization_config = {**weight_quant, "kv_cache_scheme": None}
    elif hasattr(config, "quantization_config"):
        del config.quantization_config
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the scale tensors are "unexpected keys": expected here
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, config=config,
                                                     dtype=getattr(torch, dtype),
                                                     **weight_schemes.load_options(weight_quant))
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
    except Exception as exc:  # transformers raises many types for unloadable models
        raise UsageError(f"cannot load {ckpt}: {str(exc).splitlines()[0]}") from None
    finally:
        logging.set_verbosity(verbosity)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise UsageError(f"{ckpt}: the tokenizer has {len(tokenizer)} tokens but the model's "
                         f"embedding only {vocab}: tokenizer and model do not match")
    quantsim.install(model)
    return model.eval(), tokenizer


def scales_of(found: StaticScales) -> dict[int, dict[str, Any]]:
    import torch

    scales: dict[int, dict[str, Any]] = {}
    for (layer, kind), values in found.values.items():
        scales.setdefault(layer, {})[kind] = torch.tensor(values, dtype=torch.float32)
    return scales


def load_scales(path: Path, like: StaticScales,
                notes: list[str]) -> tuple[dict[int, dict[str, Any]], str]:
    """Scales of another checkpoint of the same model in any layout verify reads, or a
    .safetensors file of scales, validated as `verify` validates a checkpoint's, and that
    checkpoint's layout. Whether vLLM would load that checkpoint (its scheme check) is
    not what eval compares; where its scales were measured goes to `notes`."""
    if path.is_file():
        checks, found = _scales_file(path, like)
    else:
        checks, found = static_checks(path)
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
    return scales_of(found), found.scheme.layout


def _scales_file(path: Path, like: StaticScales) -> tuple[list[Check], StaticScales]:
    """k/v(/q) scales named as in a checkpoint, checked against this model's shape; their
    strategy (per tensor or per head) is what the file holds."""
    if like.geometry is None:
        raise UsageError(f"--compare {path}: the checkpoint's own config is unreadable")
    scales, duplicates = layouts.find_scales(checkpoint.file_tensors(path.parent, path.name))
    per_head = any(math.prod(s.info.shape) > 1 for s in scales if s.kind != "q")
    scheme = layouts.KvScheme("scales file", strategy="attn_head" if per_head else "tensor",
                              quantizes_query=any(s.kind == "q" for s in scales))
    found = StaticScales(scheme, like.geometry)
    checks = [Check("scales", FAIL, f"{name}: a second scale for the same layer and kind")
              for name in duplicates]
    return checks + scale_checks(scales, found), found


# ----- held-out text ----- #


def held_out(report: CalibrationReport | None, tokenizer, spec: data.DatasetSpec | None,
             num_samples: int, max_seq_len: int, seed: int, notes: list[str]) -> data.Samples:
    """Held-out text: the given dataset, else the built-in corpus; rows calibration used
    (from its report) are left out when it is the same dataset.

    The report is part of the checkpoint, so it is not trusted to choose what to read: its
    dataset is used only when it is the built-in corpus or the user names it (--dataset).
    """
    calibrated_on = None
    if report is not None:
        ds = report.dataset
        calibrated_on = data.DatasetSpec(ds.source, ds.config, ds.split, ds.text_column)
    if spec is None:
        spec = data.DatasetSpec(corpus.NAME)
        if calibrated_on and calibrated_on.source != corpus.NAME:
            notes.append(f"calibration used dataset {reprlib.repr(calibrated_on.source)}; eval "
                         "reads it only when named with --dataset, so it used the built-in "
                         "corpus")
    exclude: set[int] = set()
    if report is not None and calibrated_on and spec.describe() == calibrated_on.describe():
        exclude = set(report.dataset.rows_used)
    samples = data.select_samples(spec, tokenizer, num_samples, max_seq_len, seed,
                                  exclude_rows=exclude)
    samples.dataset["excluded_calibration_rows"] = len(exclude)
    return samples


def batches(samples: data.Samples, batch_size: int, pad_id: int) -> Iterator[tuple[Any, Any]]:
    """Right-padded (input_ids, attention_mask) batches."""
    import torch

    ids = samples.token_ids
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        width = max(map(len, chunk))
        tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, seq in enumerate(chunk):
            tokens[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
        yield tokens, mask


# ----- metrics ----- #


@dataclass
class _Tally:
    kl: list[Any] = field(default_factory=list)
    kl_rows: list[tuple[float, int]] = field(default_factory=list)  # per sample: sum, tokens
    top1: list[Any] = field(default_factory=list)
    nll: list[Any] = field(default_factory=list)


def score(model, batch_list: list[tuple[Any, Any]],
          simulations: dict[str, quantsim.Simulation | None],
          progress: Callable[[], None] = lambda: None) -> tuple[float, dict[str, Metrics]]:
    """Reference perplexity and metrics of each simulation on the same batches."""
    import torch

    tallies = {name: _Tally() for name in simulations}
    ref_nll = []
    with torch.no_grad():
        for tokens, mask in batch_list:
            with quantsim.simulate(None):
                ref = torch.log_softmax(model(tokens, attention_mask=mask).logits[:, :-1].float(),
                                        -1)
            valid = mask[:, 1:].bool()
            targets = tokens[:, 1:].unsqueeze(-1)
            ref_nll.append(-ref.gather(-1, targets).squeeze(-1)[valid])
            ref_top = ref.argmax(-1)
            for name, sim in simulations.items():
                with quantsim.simulate(sim):
                    out = torch.log_softmax(
                        model(tokens, attention_mask=mask).logits[:, :-1].float(), -1)
                tally = tallies[name]
                token_kl = (ref.exp() * (ref - out)).sum(-1)
                tally.kl.append(token_kl[valid])
                tally.kl_rows += [(float(row[ok].double().sum()), int(ok.sum()))
                                  for row, ok in zip(token_kl, valid, strict=True)]
                tally.top1.append((out.argmax(-1) == ref_top)[valid])
                tally.nll.append(-out.gather(-1, targets).squeeze(-1)[valid])
                progress()
    ref_ppl = float(torch.cat(ref_nll).mean().exp())
    results = {}
    for name, tally in tallies.items():
        kl, nll = torch.cat(tally.kl).double(), torch.cat(tally.nll).double()
        ppl = float(nll.mean().exp())
        sim = simulations[name]
        clipped = {kind: count / total for kind, (count, total) in
                   (sim.clip_counts.items() if sim else []) if total}
        results[name] = Metrics(
            mean_kl=float(kl.mean()), p99_kl=float(torch.quantile(kl, 0.99)),
            top1=float(torch.cat(tally.top1).float().mean()), ppl=ppl,
            ppl_change=ppl / ref_ppl - 1, clipped=clipped, kl_by_sample=tally.kl_rows,
            mean_kl_ci=_kl_interval(tally.kl_rows))
    return ref_ppl, results


# ----- passkey ----- #


def passkey_trials(tokenizer, lengths: list[int], depths: list[float],
                   seed: int) -> list[dict[str, Any]]:
    """Filler of real text with one pass key at each depth, ending in the question."""
    filler = tokenizer("\n\n".join(d["text"] for d in corpus.documents()[-40:]),
                       add_special_tokens=False)["input_ids"]
    question = tokenizer(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        for depth in depths:
            key = rng.randint(10000, 99999)
            needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                               add_special_tokens=False)["input_ids"]
            room = length - len(needle) - len(question)
            if room <= 0 or room > len(filler):
                raise UsageError(f"passkey length {length} does not fit (needs more than "
                                 f"{len(needle) + len(question)} and at most "
                                 f"{len(filler)} filler tokens)")
            cut = int(room * depth)
            ids = filler[:cut] + needle + filler[cut:room] + question
            trials.append({"length": len(ids), "depth": depth, "key": key, "ids": ids})
    return trials


def run_passkey(model, tokenizer, trials: list[dict[str, Any]],
                simulation: quantsim.Simulation | None,
                progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    import torch

    found = []
    for trial in trials:
        with torch.no_grad(), quantsim.simulate(simulation):
            ids = torch.tensor([trial["ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        found.append({"length": trial["length"], "depth": trial["depth"],
                      "correct": str(trial["key"]) in answer, "answer": answer.strip()})
        progress()
    return {"accuracy": sum(t["correct"] for t in found) / len(found), "trials": found}


# ----- per-layer sweep ----- #


def sweep(model, batch_list, base: quantsim.Simulation, layers: list[int],
          max_kl: float | None, progress: Callable[[], None]) -> dict[str, Any]:
    """KL with one layer quantized, and with all but one; then a greedy skip set."""

    def variant(only: set[int]) -> quantsim.Simulation:
        return quantsim.Simulation(fmt=base.fmt, rounding=base.rounding, scales=base.scales,
                                   kinds=base.kinds, layers=only)

    sims = {f"only {i}": variant({i}) for i in layers}
    sims.update({f"all but {i}": variant(set(layers) - {i}) for i in layers})
    sims["all"] = variant(set(layers))
    _, metrics = score(model, batch_list, sims, progress)
    full_kl = metrics["all"].mean_kl
    per_layer = [{"layer": i, "only_kl": metrics[f"only {i}"].mean_kl,
                  "all_but_kl": metrics[f"all but {i}"].mean_kl,
                  "gain_if_skipped": full_kl - metrics[f"all but {i}"].mean_kl} for i in layers]
    ranking = sorted(per_layer, key=lambda e: (-e["gain_if_skipped"], -e["only_kl"]))
    result: dict[str, Any] = {"all_kl": full_kl, "layers": per_layer,
                              "ranking": [e["layer"] for e in ranking]}
    if max_kl is not None:
        skip: list[int] = []
        kl = full_kl
        for entry in ranking:
            if kl <= max_kl:
                break
            skip.append(entry["layer"])
            _, step = score(model, batch_list, {"s": variant(set(layers) - set(skip))}, progress)
            kl = step["s"].mean_kl
        result["recommendation"] = {
            "max_kl": max_kl, "skip_layers": sorted(skip), "kl": kl, "met": kl <= max_kl,
            "flag": ("--kv-cache-dtype-skip-layers " + " ".join(map(str, sorted(skip))))
            if skip else "(none needed)"}
    return result


# ----- the whole evaluation ----- #


def evaluate(
    ckpt: str | Path,
    *,
    dataset: data.DatasetSpec | None = None,
    num_samples: int = 16,
    max_seq_len: int = 512,
    seed: int = 0,
    batch_size: int = 1,
    dtype: str = "float32",
    rounding: str = "nearest",
    compare: Path | None = None,
    passkey_lengths: list[int] | None = None,
    passkey_depths: list[float] | None = None,
    run_sweep: bool = False,
    sweep_samples: int = 4,
    kivi: bool = False,
    kivi_group: int = 32,
    kivi_residual: int = 128,
    max_kl: float | None = None,
    max_ppl_increase: float | None = None,
    min_passkey: float | None = None,
    use_engine: bool = False,
    vllm_python: str | None = None,
    log_dir: Path | None = None,
    log: Callable[[str], None] = _stderr,
) -> EvalResult:
    """Simulate FP8 KV caches on held-out text and compare them with an exact reference."""
    from tqdm import tqdm

    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise UsageError(f"checkpoint folder not found: {ckpt}")
    if rounding not in quantsim.ROUNDINGS:
        raise UsageError(f"unknown rounding {rounding!r}; choose nearest or toward_zero")
    if batch_size <= 0:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"unknown dtype {dtype!r}; choose float32, bfloat16 or float16")
    checks, found = static_checks(ckpt)
    unreadable = [c.message for c in checks if c.status == FAIL
                  and c.group in ("config", "weights", "layers")]
    if unreadable:
        raise UsageError(f"cannot evaluate {ckpt}: {unreadable[0]}")
    report = load_report(ckpt)  # validated before the slow model load
    notes = []
    bad_scales = [c.message for c in checks if c.status == FAIL]
    own = {} if bad_scales else scales_of(found)
    if not own:
        why = f"its scales fail verify ({bad_scales[0]})" if bad_scales else "it has no KV scales"
        notes.append(f"the checkpoint's own scales are not evaluated: {why}; only the "
                     "scale-1.0 (E4M3) and E5M2 baselines are")
    model, tokenizer = load_model(ckpt, dtype)
    samples = held_out(report, tokenizer, dataset, num_samples, max_seq_len, seed, notes)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_list = list(batches(samples, batch_size, pad))

    # Queries are quantized only where the checkpoint says so (FP8 attention backends),
    # then in every configuration alike.
    kinds = ("k", "v", "q") if found.scheme and found.scheme.quantizes_query else ("k", "v")

    def fp8(scales, fmt="e4m3") -> quantsim.Simulation:
        return quantsim.Simulation(fmt=fmt, rounding=rounding, scales=scales, kinds=kinds)

    sims: dict[str, quantsim.Simulation | None] = {}
    if own:
        sims[CALIBRATED] = fp8(own)
    sims[SCALE_ONE] = fp8({})
    sims[E5M2] = fp8({}, "e5m2")
    if compare is not None:
        scales, layout = load_scales(Path(compare), found, notes)
        sims[f"compare: {Path(compare).name} ({layout}, e4m3)"] = fp8(scales)
    kivi_info = None
    if kivi and found.geometry and found.geometry.head_dim % kivi_group:
        raise UsageError(f"--kivi-group {kivi_group} must divide the head size "
                         f"{found.geometry.head_dim}")
    if kivi:
        name = f"kivi 2-bit (G={kivi_group}, R={kivi_residual})"
        sims[name] = quantsim.Simulation(mode="kivi", kivi_group=kivi_group,
                                         kivi_residual=kivi_residual, count_clipping=False)
        kivi_info = {"name": name, "group": kivi_group, "residual": kivi_residual}
    main_name = CALIBRATED if own else SCALE_ONE
    layers = found.geometry.attention_layers if found.geometry else []
    lengths = passkey_lengths or []
    context = model.config.get_text_config().max_position_embeddings
    if any(length > context for length in lengths):
        notes.append(f"passkey lengths above the model's context ({context}) were left out")
        lengths = [length for length in lengths if length <= context]
    trials = passkey_trials(tokenizer, lengths, passkey_depths or [0.5], seed) if lengths else []
    sweep_batches = batch_list[:max(1, sweep_samples // batch_size)] if run_sweep else []
    steps = (len(batch_list) * len(sims) + 2 * len(trials)
             + len(sweep_batches) * (2 * len(layers) + 1))
    log(f"Evaluating {len(sims)} configurations on {len(samples.token_ids)} held-out samples "
        f"({samples.num_tokens} tokens), {dtype}, rounding {rounding}")
    started = time.perf_counter()
    with tqdm(total=steps, desc="eval", file=sys.stderr, leave=False) as bar:
        ref_ppl, metrics = score(model, batch_list, sims, bar.update)
        passkey = None
        if trials:
            passkey = {"reference": run_passkey(model, tokenizer, trials, None, bar.update),
                       main_name: run_passkey(model, tokenizer, trials, quantsim.Simulation(
                           rounding=rounding, scales=own, kinds=kinds, count_clipping=False),
                           bar.update)}
        sweep_result = None
        if run_sweep:
            sweep_result = sweep(model, sweep_batches, sims[main_name], layers, max_kl,
                                 bar.update)
            sweep_result["samples"] = len(sweep_batches) * batch_size
    if kivi_info:
        kivi_info["bytes_per_token"] = _kivi_bytes(ckpt, kivi_group, kivi_residual,
                                                    max(map(len, samples.token_ids)))
    result = EvalResult(
        checkpoint=str(ckpt.resolve()),
        samples={**samples.dataset, "count": len(samples.token_ids), "tokens": samples.num_tokens,
                 "max_seq_len": max_seq_len, "dtype": dtype, "rounding": rounding,
                 "seconds": round(time.perf_counter() - started, 1)},
        reference_ppl=ref_ppl, metrics=metrics, notes=notes, passkey=passkey,
        sweep=sweep_result, kivi=kivi_info, verdict=_verdict(metrics) if own else "",
        layer_scales=_layer_scales(found))
    if use_engine:
        result.engine = _engine_cross_check(ckpt, samples, found, vllm_python, log_dir, log)
    result.checks = _gates(result, main_name, max_kl, max_ppl_increase, min_passkey)
    return result


def _kl_interval(rows: list[tuple[float, int]]) -> tuple[float, float] | None:
    """95% bootstrap interval of the token-weighted mean KL over samples."""
    if len(rows) < 2:
        return None
    found = stats.bootstrap(np.array(rows, dtype=float), stats.ratio_of_sums)
    return found.low, found.high


def _verdict(metrics: dict[str, Metrics]) -> str:
    """What calibration buys against scale 1.0, said plainly: a difference whose paired
    95% interval over the samples includes zero is within noise, however large it looks."""
    ours, unit = metrics[CALIBRATED], metrics[SCALE_ONE]
    both = f"mean KL {ours.mean_kl:.4g} calibrated vs {unit.mean_kl:.4g} at scale 1.0"
    if len(ours.kl_by_sample) < 2:
        return f"{both}; one sample gives no interval: use more --num-samples to decide"
    found = stats.paired_bootstrap(ours.kl_pairs(), unit.kl_pairs(), stats.ratio_of_sums)
    gain = found.difference  # scale 1.0 minus calibrated
    interval = (f"95% interval of the difference {gain.low:.3g} to {gain.high:.3g} over "
                f"{found.samples} samples")
    if found.within_noise:
        needed = stats.samples_needed(found)
        more = f"; about {needed} samples would tell them apart" if needed else ""
        return f"calibration gains nothing measurable (within noise): {both} ({interval}{more})"
    if gain.estimate < 0:
        return f"calibrated scales are worse than scale 1.0: {both} ({interval})"
    if ours.mean_kl * 10 <= unit.mean_kl:
        cut = unit.mean_kl / ours.mean_kl
        return f"calibrated scales cut mean KL {cut:.0f}x: {both} ({interval})"
    return (f"calibrated scales lower mean KL by {1 - ours.mean_kl / unit.mean_kl:.0%}: {both} "
            f"({interval})")


def _kivi_bytes(ckpt: Path, group: int, residual: int, tokens: int) -> dict[str, Any]:
    """Real bytes per token of each format for requests as long as the eval's samples."""
    from kvcalib import capacity

    est = capacity.from_config(checkpoint.load_config(ckpt), context_length=tokens,
                               kivi=capacity.Kivi(group, residual))
    per_token = {f.name: f.request_bytes / tokens for f in est.formats}
    kivi = next(f for f in est.formats if f.name == "kivi2")
    return {"tokens": tokens, "kivi": per_token["kivi2"], "fp8": per_token["fp8"],
            "16bit": per_token[est.dtype], "kivi_long_context": kivi.bytes_per_token}


def _engine_cross_check(ckpt: Path, samples: data.Samples, found: StaticScales,
                        vllm_python: str | None, log_dir: Path | None,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """vLLM prompt log-probs on the same token ids, with fp8 and with the model dtype."""
    try:
        python, _ = engine.resolve_vllm_python(vllm_python)
    except UsageError as exc:
        return {"error": str(exc)}
    log_dir = Path(log_dir) if log_dir else Path("kvcalib-eval-logs") / ckpt.resolve().name
    baseline = engine.unquantized_cache_dtype(found.geometry and found.geometry.dtype)
    runs = {}
    for dtype in ("fp8", baseline):
        log(f"Starting vLLM with kv_cache_dtype={dtype}; log: {log_dir / f'vllm-{dtype}.log'}")
        runs[dtype] = engine.run_probe(python, ckpt, dtype, log_dir / f"vllm-{dtype}.log",
                                       prompts=samples.token_ids, max_tokens=1,
                                       max_model_len=max(map(len, samples.token_ids)) + 8)
    fp8, base = runs["fp8"], runs[baseline]
    result = engine.compare_runs(fp8, base)
    result["logs"] = {k: str(v.log_path) for k, v in runs.items()}
    if not fp8.started:
        result["error"] = fp8.result.get("error") or "vLLM did not start with fp8"
        if fp8.facts.hardware:
            result["error"] = ("vLLM on this machine cannot run an FP8 KV cache "
                               f"({fp8.facts.hardware})")
    return result


def _gates(result: EvalResult, main: str, max_kl: float | None,
           max_ppl_increase: float | None, min_passkey: float | None) -> list[Check]:
    checks = [Check("note", WARN, note) for note in result.notes]
    metrics = result.metrics[main]
    if max_kl is not None:
        ok = metrics.mean_kl <= max_kl
        checks.append(Check("gate", PASS if ok else FAIL, f"{main}: mean KL {metrics.mean_kl:.5f}"
                            f" {'<=' if ok else '>'} --max-kl {max_kl}", value=metrics.mean_kl))
    if max_ppl_increase is not None:
        ok = metrics.ppl_change <= max_ppl_increase
        checks.append(Check("gate", PASS if ok else FAIL, f"{main}: perplexity change "
                            f"{metrics.ppl_change:+.2%} {'<=' if ok else '>'} "
                            f"--max-ppl-increase {max_ppl_increase:.2%}",
                            value=metrics.ppl_change))
    if min_passkey is not None:
        if result.passkey is None:
            checks.append(Check("gate", ERROR, "--min-passkey needs --passkey-lengths"))
        else:
            accuracy = result.passkey[main]["accuracy"]
            ok = accuracy >= min_passkey
            checks.append(Check("gate", PASS if ok else FAIL, f"{main}: passkey accuracy "
                                f"{accuracy:.0%} {'>=' if ok else '<'} --min-passkey "
                                f"{min_passkey:.0%}", value=accuracy))
    if result.sweep and "recommendation" in result.sweep:
        rec = result.sweep["recommendation"]
        checks.append(Check("sweep", PASS if rec["met"] else WARN,
                            f"skip set for KL <= {rec['max_kl']}: {rec['flag']} (KL "
                            f"{rec['kl']:.5f})", value=rec))
    if result.engine is not None:
        if "error" in result.engine:
            checks.append(Check("engine", ERROR, f"engine cross-check: {result.engine['error']}"))
        else:
            out = result.engine["outputs"]
            checks.append(Check("engine", PASS, f"vLLM fp8 vs model dtype: perplexity "
                                f"{out['ppl_fp8']:.4g} vs {out['ppl_auto']:.4g}, top-1 agreement "
                                f"{out['top1_agreement']:.1%}"))
    if not any(c.group == "gate" for c in checks):
        checks.append(Check("gate", SKIP, "no gate set (--max-kl, --max-ppl-increase, "
                            "--min-passkey)"))
    return checks


def _layer_scales(found: StaticScales) -> dict[str, Any]:
    """Largest k/v scale per attention layer (None where missing), for plots."""
    layers = found.geometry.attention_layers if found.geometry else []
    scales: dict[str, Any] = {"layers": layers}
    for kind in ("k", "v"):
        scales[kind] = [float(np.max(found.values[(i, kind)])) if (i, kind) in found.values
                        else None for i in layers]
    return scales


def plot(result: EvalResult, path: Path) -> Path:
    """Per-layer sensitivity (from the sweep) above the checkpoint's scales per layer."""
    from kvcalib import plots

    layers = result.layer_scales.get("layers", [])
    bars = {}
    if result.sweep:
        by_layer = {e["layer"]: e for e in result.sweep["layers"]}
        layers = layers or sorted(by_layer)
        bars = {"KL, only this layer FP8": [by_layer[i]["only_kl"] for i in layers],
                "KL saved by skipping it": [by_layer[i]["gain_if_skipped"] for i in layers]}
    lines = {f"{kind}_scale": [np.nan if v is None else v for v in result.layer_scales[kind]]
             for kind in ("k", "v") if any(v is not None for v in
                                           result.layer_scales.get(kind, []))}
    if not bars and not lines:
        raise UsageError("nothing to plot: no per-layer sweep (--sweep) and no scales")
    return plots.sensitivity(path, layers, bars, lines, f"FP8 KV sensitivity: "
                             f"{Path(result.checkpoint).name}")
