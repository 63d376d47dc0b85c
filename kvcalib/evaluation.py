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
- optionally every vLLM KV format (--formats, kvcalib.kvformats) with its tokens at a
  memory budget (kvcalib.capacity), each row's difference from calibrated FP8 with a
  paired 95% interval, a Pareto plot, and the highest-capacity format that meets the
  gates on a --target;
- optionally the real engine: vLLM prompt log-probs with fp8 against the model dtype.
"""

from __future__ import annotations

import dataclasses
import math
import random
import reprlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib import (
    capacity,
    checkpoint,
    choices,
    corpus,
    data,
    engine,
    kvformats,
    layouts,
    quantsim,
    stats,
)
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, WARN, Check, exit_code
from kvcalib.errors import UsageError
from kvcalib.kvcheckpoint import Checkpoint, KvScales, open_checkpoint, scale_checks
from kvcalib.schema import CalibrationReport

CALIBRATED, SCALE_ONE, E5M2 = "calibrated (e4m3)", "scale 1.0 (e4m3)", "scale 1.0 (e5m2)"
REFERENCE_FORMAT = "auto"  # the model dtype: what every format is sized against
DEFAULT_BUDGET = "16GiB"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Gates:
    """eval's thresholds (None: not set). A release pipeline gates on them: exit 1 when the
    checkpoint's scales (or, comparing formats, every quantized format) miss one."""

    max_kl: float | None = None
    max_ppl_increase: float | None = None  # a fraction: 0.01 is 1%
    min_passkey: float | None = None

    @property
    def any_set(self) -> bool:
        return any(value is not None for value in astuple(self))

    def met(self, kl: float, ppl_change: float, passkey: float | None) -> bool:
        return ((self.max_kl is None or kl <= self.max_kl)
                and (self.max_ppl_increase is None or ppl_change <= self.max_ppl_increase)
                and (self.min_passkey is None
                     or (passkey is not None and passkey >= self.min_passkey)))


@dataclass(frozen=True)
class HeldOut:
    """The held-out text eval scores. No dataset: the calibration's when it is the built-in
    corpus (rows it did not use), else the built-in corpus (see `held_out_samples`)."""

    dataset: data.DatasetSpec | None = None
    num_samples: int = 16
    max_seq_len: int = 512
    seed: int = 0
    batch_size: int = 1


@dataclass(frozen=True)
class Formats:
    """Which vLLM KV formats to compare (`names`: 'all' or kv_cache_dtype names), on what
    hardware, and the memory their tokens are counted at. block_size: vLLM's, by default
    128 on CPU targets and 16 elsewhere."""

    names: list[str]
    target: str | None = None
    budget: str | int = DEFAULT_BUDGET
    block_size: int | None = None


@dataclass(frozen=True)
class Passkey:
    """Passkey prompts of `lengths` tokens, with the key at each of `depths` (fractions)."""

    lengths: list[int]
    depths: list[float] = field(default_factory=lambda: [0.5])


@dataclass(frozen=True)
class LayerSweep:
    """The per-layer sweep, on the first `samples` held-out samples (2 or more: its
    effects come with intervals)."""

    samples: int = 4


@dataclass(frozen=True)
class EngineCheck:
    """Score the same tokens in vLLM too (the serving env's python; logs in log_dir)."""

    vllm_python: str | None = None
    log_dir: Path | None = None


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
    nll_by_sample: list[tuple[float, int]] = field(default_factory=list)  # summed NLL, tokens

    def kl_pairs(self) -> np.ndarray:
        return np.array(self.kl_by_sample, dtype=float).reshape(-1, 2)

    def nll_pairs(self) -> np.ndarray:
        return np.array(self.nll_by_sample, dtype=float).reshape(-1, 2)


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
    formats: dict[str, Any] | None = None  # --formats: rows, recommendation, top two
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


def load_model(ckpt: Checkpoint, dtype: str):
    """The checkpoint's model without its KV quantization (quantsim simulates it);
    quantized weights are decompressed to their quantized values (kvcalib.weight_schemes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from kvcalib import weight_schemes

    config = AutoConfig.from_pretrained(ckpt.folder)  # transformers' own config object
    weight_quant = weight_schemes.input_quantization(ckpt.folder, ckpt.config)
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
    quantsim.install(model)
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
    scales, duplicates = layouts.find_scales(checkpoint.file_tensors(path.parent, path.name))
    per_head = any(math.prod(s.info.shape) > 1 for s in scales if s.kind != "q")
    scheme = layouts.KvScheme("scales file", strategy="attn_head" if per_head else "tensor",
                              quantizes_query=any(s.kind == "q" for s in scales))
    checks = [Check("scales", FAIL, f"{name}: a second scale for the same layer and kind")
              for name in duplicates]
    more, valid = scale_checks(scales, scheme, like.geometry)
    return checks + more, Checkpoint(path, geometry=like.geometry, scheme=scheme, scales=valid)


# ----- held-out text ----- #


def held_out_samples(report: CalibrationReport | None, tokenizer, held_out: HeldOut,
                     notes: list[str]) -> data.Samples:
    """Held-out text: the given dataset, else the built-in corpus; rows calibration used
    (from its report) are left out when it is the same dataset.

    The report is part of the checkpoint, so it is not trusted to choose what to read: its
    dataset is used only when it is the built-in corpus or the user names it (--dataset).
    """
    spec, calibrated_on = held_out.dataset, None
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
    samples = data.select_samples(spec, tokenizer, held_out.num_samples, held_out.max_seq_len,
                                  held_out.seed, exclude_rows=exclude)
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
    nll_rows: list[tuple[float, int]] = field(default_factory=list)


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
                token_nll = -out.gather(-1, targets).squeeze(-1)
                tally.nll.append(token_nll[valid])
                tally.nll_rows += [(float(row[ok].double().sum()), int(ok.sum()))
                                   for row, ok in zip(token_nll, valid, strict=True)]
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
            mean_kl_ci=_kl_interval(tally.kl_rows), nll_by_sample=tally.nll_rows)
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
        sim = simulation
        if sim is not None and sim.format is not None and sim.format.exact_first_chunk:
            # vLLM's first prefill chunk (the whole prompt here) attends to the exact K/V;
            # the generated tokens read the stored cache, prompt included.
            sim = dataclasses.replace(sim, exact_prefix=len(trial["ids"]))
        with torch.no_grad(), quantsim.simulate(sim):
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
    """KL with one layer quantized, and with all but one; then a greedy skip set.

    What skipping a layer saves is a paired difference over the sweep's samples: a layer
    whose 95% interval includes zero is marked within noise and never recommended."""

    def variant(only: set[int]) -> quantsim.Simulation:
        return quantsim.Simulation(fmt=base.fmt, rounding=base.rounding, scales=base.scales,
                                   kinds=base.kinds, layers=only)

    sims = {f"only {i}": variant({i}) for i in layers}
    sims.update({f"all but {i}": variant(set(layers) - {i}) for i in layers})
    sims["all"] = variant(set(layers))
    _, metrics = score(model, batch_list, sims, progress)
    full_kl = metrics["all"].mean_kl
    per_layer = []
    for i in layers:
        # all-but minus all: the saving is its negative
        saved = stats.paired_bootstrap(metrics["all"].kl_pairs(),
                                       metrics[f"all but {i}"].kl_pairs(),
                                       stats.ratio_of_sums).difference
        per_layer.append({"layer": i, "only_kl": metrics[f"only {i}"].mean_kl,
                          "all_but_kl": metrics[f"all but {i}"].mean_kl,
                          "gain_if_skipped": full_kl - metrics[f"all but {i}"].mean_kl,
                          "gain_interval": [-saved.high, -saved.low],
                          "within_noise": not saved.excludes_zero})
    ranking = sorted(per_layer, key=lambda e: (-e["gain_if_skipped"], -e["only_kl"]))
    result: dict[str, Any] = {"all_kl": full_kl, "layers": per_layer,
                              "ranking": [e["layer"] for e in ranking],
                              "within_noise": [e["layer"] for e in per_layer
                                               if e["within_noise"]]}
    if max_kl is not None:
        skip: list[int] = []
        kl = full_kl
        for entry in ranking:
            if kl <= max_kl:
                break
            if entry["within_noise"] or entry["gain_if_skipped"] <= 0:
                continue
            skip.append(entry["layer"])
            _, step = score(model, batch_list, {"s": variant(set(layers) - set(skip))}, progress)
            kl = step["s"].mean_kl
        result["recommendation"] = {
            "max_kl": max_kl, "skip_layers": sorted(skip), "kl": kl, "met": kl <= max_kl,
            "flag": ("--kv-cache-dtype-skip-layers " + " ".join(map(str, sorted(skip))))
            if skip else "(none needed)" if kl <= max_kl else "(none that is not noise)"}
    return result


# ----- every vLLM KV format ----- #



@dataclass
class FormatRow:
    """One row of the format comparison: a vLLM --kv-cache-dtype with one choice of static
    scales, its capacity, and (unless n/a) its metrics under `metrics_key`."""

    label: str
    format: str
    scales: str  # "calibrated", "scale 1.0", "dynamic", or "" (the model dtype)
    runs_on: dict[str, str]  # target -> attention backend
    bytes_per_token: float | None = None  # every attention layer full, kept layers 16-bit
    tokens_at_budget: int | None = None
    metrics_key: str | None = None  # in EvalResult.metrics; None: n/a or the model dtype
    note: str = ""
    vs_reference: dict[str, Any] | None = None  # paired differences from calibrated FP8
    passkey: float | None = None
    meets_gates: bool | None = None  # None: no gate set


def format_names(requested: list[str], target: str | None) -> list[str]:
    """--formats (all, or vLLM kv_cache_dtype names, to which auto and fp8 are added) as
    names, filtered to the target; unknown names and targets are usage errors that list
    the valid ones."""
    if target is not None and target not in kvformats.TARGETS:
        raise UsageError(f"unknown --target {target!r}; valid: {', '.join(kvformats.TARGETS)}")
    valid = list(kvformats.FORMATS)
    if requested == ["all"]:
        names = [name for name in valid if name != "fp8_e4m3"]  # fp8_e4m3 is fp8
    else:
        unknown = [name for name in requested if name not in valid]
        if unknown:
            raise UsageError(f"unknown format {unknown[0]!r}; valid: all, {', '.join(valid)}")
        # The model dtype and FP8 (the reference configuration) are always rows.
        names = list(dict.fromkeys([REFERENCE_FORMAT, "fp8", *requested]))
    return [name for name in names
            if target is None or target in kvformats.FORMATS[name].runs_on]


def nvfp4_scales(own: dict[int, dict[str, Any]], kv_cache_dtype: str) -> dict[int, dict[str, Any]]:
    """Per-tensor NVFP4 global scales from the calibration, as ModelOpt exports them: the
    absmax the FP8 scale implies (scale · 448, the largest head), over 6 · block ceiling."""
    import torch

    fp8_max = quantsim.FP8["e4m3"][1]
    return {layer: {kind: torch.tensor(kvformats.nvfp4_global_scale(
        float(scale.max()) * fp8_max, kv_cache_dtype)) for kind, scale in kinds.items()
        if kind in ("k", "v")} for layer, kinds in own.items()}


def plan_formats(names: list[str], ckpt: Checkpoint, own: dict[int, dict[str, Any]],
                 kinds: tuple[str, ...], rounding: str,
                 budget: int, block_size: int, context: int, target: str | None,
                 known: dict[tuple[str, str], str]
                 ) -> tuple[list[FormatRow], dict[str, quantsim.Simulation]]:
    """The rows, sized by kvcalib.capacity (vLLM's page accounting), and the simulations
    still to score: static formats with the checkpoint's scales and at 1.0, except the FP8
    configurations `known` already scores ((element type, scales) -> metrics key)."""
    est = capacity.from_config(ckpt.config, context_length=context, budget=budget,
                               block_size=block_size, formats=names)
    sizes = dict(zip(names, est.formats, strict=True))
    shape = ckpt.geometry
    kv_shape = kvformats.Geometry(est.num_kv_heads, est.head_dim, est.dtype,
                                  mla=est.mla_latent_dim is not None)
    hybrid = any(layer.kind == "none" and layer.block_type not in ("mlp", "moe")
                 for layer in shape.layers)
    rows, sims = [], {}
    for name in names:
        fmt, size = kvformats.FORMATS[name], sizes[name]
        base = FormatRow(name, name, "", fmt.runs_on, size.bytes_per_token, size.tokens_fit)
        reason = fmt.unsupported(kv_shape, target)
        if reason:
            rows.append(dataclasses.replace(base, label=name, note=f"n/a: {reason}"))
            continue
        if not fmt.quantized:
            rows.append(base)
            continue
        layers = kvformats.quantized_layers(fmt, shape.attention_layers, shape.num_layers,
                                            hybrid)
        variants: dict[str, dict[int, dict[str, Any]]] = {"dynamic": {}}
        if fmt.static_scales == "fp8":
            variants = {"calibrated": own, "scale 1.0": {}} if own else {"scale 1.0": {}}
        elif fmt.static_scales == "nvfp4":
            variants = {"scale 1.0": {}}
            if own:
                variants = {"calibrated": nvfp4_scales(own, name), **variants}
        for scales_name, scales in variants.items():
            sim = quantsim.Simulation(format=fmt, rounding=rounding, scales=scales,
                                      kinds=kinds if fmt.fp8 else ("k", "v"), layers=layers,
                                      count_clipping=bool(fmt.fp8))
            label = name if scales_name == "dynamic" else f"{name} ({scales_name})"
            key = known.get((fmt.fp8 or "", scales_name), label)
            if key == label:
                sims[label] = sim
            note = size.note
            if fmt.static_scales == "nvfp4" and scales_name == "calibrated":
                note = ("global scales absmax / (6 x block max), as ModelOpt exports; this "
                        "checkpoint stores FP8 scales, which vLLM would read as the global "
                        "scale")
            rows.append(dataclasses.replace(base, label=label, scales=scales_name,
                                            metrics_key=key, note=note))
    return rows, sims


def _difference(found: stats.Comparison) -> dict[str, Any]:
    d = found.difference
    return {"difference": d.estimate, "low": d.low, "high": d.high,
            "within_noise": found.within_noise, "samples": found.samples,
            "samples_needed": stats.samples_needed(found)}


def compare_to(reference: Metrics, other: Metrics) -> dict[str, Any] | None:
    """Mean KL and perplexity of `other` minus `reference`, with paired 95% intervals over
    the same samples; None with one sample."""
    if len(reference.kl_by_sample) < 2:
        return None
    return {"mean_kl": _difference(stats.paired_bootstrap(
                reference.kl_pairs(), other.kl_pairs(), stats.ratio_of_sums)),
            "ppl": _difference(stats.paired_bootstrap(
                reference.nll_pairs(), other.nll_pairs(), stats.perplexity))}


def meets_gates(row: FormatRow, metrics: dict[str, Metrics], reference_passkey: float | None,
                gates: Gates) -> bool | None:
    """Whether a row passes every gate set (None: none set, or the row is n/a). The model
    dtype is the reference itself: KL 0, no perplexity change, the reference's passkey."""
    if not gates.any_set or row.note.startswith("n/a"):
        return None
    m = metrics.get(row.metrics_key or "")
    kl, ppl_change = (m.mean_kl, m.ppl_change) if m else (0.0, 0.0)
    return gates.met(kl, ppl_change, row.passkey if m else reference_passkey)


def recommend(rows: list[FormatRow], metrics: dict[str, Metrics]) -> FormatRow | None:
    """The row with the most tokens at the budget among those that meet the gates (ties:
    the lower mean KL); None when no gate is set."""
    passing = [row for row in rows if row.meets_gates]
    if not passing:
        return None
    return max(passing, key=lambda row: (row.tokens_at_budget or 0,
                                         -metrics[row.metrics_key].mean_kl
                                         if row.metrics_key else 0.0))


def top_two(rows: list[FormatRow], metrics: dict[str, Metrics]) -> dict[str, Any] | None:
    """The two quantized rows with the lowest mean KL: does the first beat the second, and
    how many samples would tell them apart?"""
    ranked = sorted((row for row in rows if row.metrics_key),
                    key=lambda row: metrics[row.metrics_key].mean_kl)
    ranked = list({row.metrics_key: row for row in reversed(ranked)}.values())[::-1]
    if len(ranked) < 2 or len(metrics[ranked[0].metrics_key].kl_by_sample) < 2:
        return None
    first, second = ranked[:2]
    found = stats.paired_bootstrap(metrics[first.metrics_key].kl_pairs(),
                                   metrics[second.metrics_key].kl_pairs(), stats.ratio_of_sums)
    return {"first": first.label, "second": second.label, **_difference(found)}


def _format_comparison(rows: list[FormatRow], result: EvalResult, reference: str,
                       gates: Gates, target: str | None, budget: int, block_size: int
                       ) -> dict[str, Any]:
    """Fill in each row's statistics and gates, then rank."""
    metrics = result.metrics
    passkey = result.passkey or {}
    reference_passkey = passkey["reference"]["accuracy"] if passkey else None
    for row in rows:
        if row.metrics_key:
            if row.metrics_key != reference:
                row.vs_reference = compare_to(metrics[reference], metrics[row.metrics_key])
            if row.metrics_key in passkey:
                row.passkey = passkey[row.metrics_key]["accuracy"]
        elif not row.note.startswith("n/a"):
            row.passkey = reference_passkey
        row.meets_gates = meets_gates(row, metrics, reference_passkey, gates)
    best = recommend(rows, metrics)
    return {"target": target, "budget_bytes": budget, "block_size": block_size,
            "reference": reference, "gates": asdict(gates),
            "rows": [asdict(row) for row in rows],
            "recommendation": None if best is None else {
                "label": best.label, "format": best.format,
                "tokens_at_budget": best.tokens_at_budget,
                "quantized": best.metrics_key is not None,
                "flag": f"--kv-cache-dtype {best.format}"},
            "top_two": top_two(rows, metrics)}


# ----- the whole evaluation ----- #


def evaluate(
    ckpt: str | Path,
    *,
    held_out: HeldOut = HeldOut(),
    dtype: str = "float32",
    rounding: str | None = None,
    compare: Path | None = None,
    formats: Formats | None = None,
    passkey: Passkey | None = None,
    layer_sweep: LayerSweep | None = None,
    kivi: capacity.Kivi | None = None,
    gates: Gates = Gates(),
    engine_check: EngineCheck | None = None,
    log: Callable[[str], None] = _stderr,
) -> EvalResult:
    """Simulate FP8 KV caches (and with `formats`, every vLLM KV format) on held-out text
    and compare them with an exact reference.

    rounding: FP8 stores' rounding, by default the formats' target's (vllm-cpu
    truncates), else nearest. kivi: also simulate 2-bit KIVI."""
    from tqdm import tqdm

    folder = Path(ckpt)
    if not folder.is_dir():
        raise UsageError(f"checkpoint folder not found: {folder}")
    target = formats.target if formats else None
    names = format_names(formats.names, target) if formats else None
    if rounding is None:
        rounding = kvformats.TARGETS[target].fp8_rounding if target else "nearest"
    block_size = formats.block_size if formats else None
    if block_size is None:
        block_size = 128 if target and target.startswith("cpu") else capacity.DEFAULT_BLOCK_SIZE
    budget = formats.budget if formats else DEFAULT_BUDGET
    budget_bytes = capacity.parse_budget(budget) if isinstance(budget, str) else budget
    num_samples, batch_size = held_out.num_samples, held_out.batch_size
    if layer_sweep and min(layer_sweep.samples, num_samples) < 2:
        raise UsageError("--sweep needs at least 2 samples (--sweep-samples and "
                         "--num-samples) to tell a layer's effect from noise")
    choices.check("rounding", rounding, choices.Rounding)
    if batch_size <= 0:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    choices.check("dtype", dtype, choices.EvalDtype)
    opened, checks = open_checkpoint(folder)
    unreadable = [c.message for c in checks if c.status == FAIL
                  and c.group in ("config", "weights", "layers")]
    if unreadable:
        raise UsageError(f"cannot evaluate {folder}: {unreadable[0]}")
    report = opened.report  # validated before the slow model load
    notes = []
    bad_scales = [c.message for c in checks if c.status == FAIL]
    own = {} if bad_scales else opened.scales.to_torch()
    if not own:
        why = f"its scales fail verify ({bad_scales[0]})" if bad_scales else "it has no KV scales"
        notes.append(f"the checkpoint's own scales are not evaluated: {why}; only the "
                     "scale-1.0 (E4M3) and E5M2 baselines are")
    model, tokenizer = load_model(opened, dtype)
    samples = held_out_samples(report, tokenizer, held_out, notes)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_list = list(batches(samples, batch_size, pad))

    # Queries are quantized only where the checkpoint says so (FP8 attention backends),
    # then in every configuration alike.
    kinds = opened.kinds

    def fp8(scales, fmt="e4m3") -> quantsim.Simulation:
        return quantsim.Simulation(fmt=fmt, rounding=rounding, scales=scales, kinds=kinds)

    sims: dict[str, quantsim.Simulation | None] = {}
    if own:
        sims[CALIBRATED] = fp8(own)
    sims[SCALE_ONE] = fp8({})
    sims[E5M2] = fp8({}, "e5m2")
    if compare is not None:
        scales, layout = load_scales(Path(compare), opened, notes)
        sims[f"compare: {Path(compare).name} ({layout}, e4m3)"] = fp8(scales.to_torch())
    kivi_info = None
    if kivi and opened.geometry and opened.geometry.head_dim % kivi.group_size:
        raise UsageError(f"--kivi-group-size {kivi.group_size} must divide the head size "
                         f"{opened.geometry.head_dim}")
    if kivi:
        name = f"kivi 2-bit (G={kivi.group_size}, R={kivi.residual})"
        sims[name] = quantsim.Simulation(mode="kivi", kivi=kivi, count_clipping=False)
        kivi_info = {"name": name, "group": kivi.group_size, "residual": kivi.residual}
    main_name = CALIBRATED if own else SCALE_ONE
    rows: list[FormatRow] = []
    if names:
        known = {("e4m3", "calibrated"): CALIBRATED, ("e4m3", "scale 1.0"): SCALE_ONE,
                 ("e5m2", "scale 1.0"): E5M2}
        rows, more = plan_formats(names, opened, own, kinds, rounding, budget_bytes,
                                  block_size, held_out.max_seq_len, target, known)
        sims.update(more)
    layers = opened.geometry.attention_layers if opened.geometry else []
    lengths = passkey.lengths if passkey else []
    context = model.config.get_text_config().max_position_embeddings
    if any(length > context for length in lengths):
        notes.append(f"passkey lengths above the model's context ({context}) were left out")
        lengths = [length for length in lengths if length <= context]
    trials = (passkey_trials(tokenizer, lengths, passkey.depths, held_out.seed)
              if passkey and lengths else [])
    sweep_batches = (batch_list[:math.ceil(layer_sweep.samples / batch_size)]
                     if layer_sweep else [])
    passkey_sims = {main_name: quantsim.Simulation(rounding=rounding, scales=own, kinds=kinds,
                                                   count_clipping=False)}
    passkey_sims.update({row.metrics_key: sims[row.metrics_key] for row in rows
                         if row.metrics_key and row.metrics_key != main_name})
    steps = (len(batch_list) * len(sims) + (1 + len(passkey_sims)) * len(trials)
             + len(sweep_batches) * (2 * len(layers) + 1))
    log(f"Evaluating {len(sims)} configurations on {len(samples.token_ids)} held-out samples "
        f"({samples.num_tokens} tokens), {dtype}, rounding {rounding}")
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
        if layer_sweep:
            sweep_result = sweep(model, sweep_batches, sims[main_name], layers, gates.max_kl,
                                 bar.update)
            sweep_result["samples"] = sum(len(tokens) for tokens, _ in sweep_batches)
    if kivi_info:
        kivi_info["bytes_per_token"] = _kivi_bytes(opened.config, kivi,
                                                   max(map(len, samples.token_ids)))
    result = EvalResult(
        checkpoint=str(opened.folder.resolve()),
        samples={**samples.dataset, "count": len(samples.token_ids), "tokens": samples.num_tokens,
                 "max_seq_len": held_out.max_seq_len, "dtype": dtype, "rounding": rounding,
                 "seconds": round(time.perf_counter() - started, 1)},
        reference_ppl=ref_ppl, metrics=metrics, notes=notes, passkey=passkey_result,
        sweep=sweep_result, kivi=kivi_info, verdict=_verdict(metrics) if own else "",
        layer_scales=_layer_scales(opened))
    if rows:
        result.formats = _format_comparison(rows, result, main_name, gates, target,
                                            budget_bytes, block_size)
    if engine_check:
        result.engine = _engine_cross_check(opened, samples, engine_check, log)
    result.checks = _gates(result, main_name, gates)
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


def _kivi_bytes(config: dict[str, Any], kivi: capacity.Kivi, tokens: int) -> dict[str, Any]:
    """Real bytes per token of each format for requests as long as the eval's samples."""
    est = capacity.from_config(config, context_length=tokens, kivi=kivi)
    per_token = {f.name: f.request_bytes / tokens for f in est.formats}
    kivi2 = next(f for f in est.formats if f.name == "kivi2")
    return {"tokens": tokens, "kivi": per_token["kivi2"], "fp8": per_token["fp8"],
            "16bit": per_token[est.dtype], "kivi_long_context": kivi2.bytes_per_token}


def _engine_cross_check(ckpt: Checkpoint, samples: data.Samples, options: EngineCheck,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """vLLM prompt log-probs on the same token ids, with fp8 and with the model dtype."""
    try:
        python, _ = engine.resolve_vllm_python(options.vllm_python)
    except UsageError as exc:
        return {"error": str(exc)}
    log_dir = Path(options.log_dir or Path("kvcalib-eval-logs") / ckpt.folder.resolve().name)
    baseline = engine.unquantized_cache_dtype(ckpt.geometry and ckpt.geometry.dtype)
    runs = {}
    for dtype in ("fp8", baseline):
        log(f"Starting vLLM with kv_cache_dtype={dtype}; log: {log_dir / f'vllm-{dtype}.log'}")
        runs[dtype] = engine.run_probe(python, ckpt.folder, dtype, log_dir / f"vllm-{dtype}.log",
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


def _gates(result: EvalResult, main: str, gates: Gates) -> list[Check]:
    checks = [Check("note", WARN, note) for note in result.notes]
    if result.formats is not None:  # the gates choose a format instead
        checks += _recommendation_checks(result.formats, gates, result.passkey is None)
    else:
        checks += _main_gates(result, main, gates)
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


def _main_gates(result: EvalResult, main: str, gates: Gates) -> list[Check]:
    """The gates on the checkpoint's own scales (or scale 1.0 without them)."""
    checks = []
    metrics = result.metrics[main]
    max_kl, max_ppl_increase, min_passkey = astuple(gates)
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
    return checks


def _recommendation_checks(formats: dict[str, Any], gates: Gates, no_passkey: bool
                           ) -> list[Check]:
    """With gates: pass when a quantized format meets them on the target, else fail."""
    if not gates.any_set:
        return []
    if gates.min_passkey is not None and no_passkey:
        return [Check("gate", ERROR, "--min-passkey needs --passkey-lengths")]
    best = formats["recommendation"]
    where = f" on {formats['target']}" if formats["target"] else ""
    if best is None or not best["quantized"]:
        return [Check("gate", FAIL, f"no quantized KV format{where} meets the gates; keep "
                      "the model dtype (--kv-cache-dtype auto)")]
    return [Check("gate", PASS, f"{best['label']} meets the gates{where} with the most "
                  f"tokens at the budget ({best['tokens_at_budget']:,}): {best['flag']}",
                  value=best)]


def _layer_scales(ckpt: Checkpoint) -> dict[str, Any]:
    """Largest k/v scale per attention layer (None where missing), for plots."""
    layers = ckpt.geometry.attention_layers if ckpt.geometry else []
    scales: dict[str, Any] = {"layers": layers}
    for kind in ("k", "v"):
        scales[kind] = [float(np.max(scale.values)) if (scale := ckpt.scales.get(i, kind))
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
                             f"{Path(result.checkpoint).name}",
                             noise=result.sweep["within_noise"] if result.sweep else ())


def pareto_plot(result: EvalResult, path: Path) -> Path:
    """Tokens at the budget against mean KL for every format row that was scored."""
    from kvcalib import plots

    if not result.formats:
        raise UsageError("nothing to plot: the Pareto plot needs --formats")
    points, reference = {}, None
    for row in result.formats["rows"]:
        m = result.metrics.get(row["metrics_key"] or "")
        if m is not None:
            low, high = m.mean_kl_ci or (m.mean_kl, m.mean_kl)
            points[row["label"]] = (row["tokens_at_budget"], m.mean_kl, low, high)
        elif not row["note"].startswith("n/a"):
            reference = (row["label"], row["tokens_at_budget"])
    target = result.formats["target"]
    budget = result.formats["budget_bytes"] / 2**30
    return plots.pareto(path, points, reference, f"tokens in a {budget:g} GiB KV cache",
                        f"KV formats{' on ' + target if target else ''}: "
                        f"{Path(result.checkpoint).name}")
