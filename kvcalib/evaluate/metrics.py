"""Scoring a simulated KV cache against the exact model on the same tokens: per-token KL,
top-1 agreement, perplexity and clipping, with each sample's sums kept so that every
comparison comes with a paired bootstrap interval (kvcalib.stats).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcalib import stats
from kvcalib.data import Samples

if TYPE_CHECKING:  # simulate imports torch; results and reports are read without it
    from kvcalib.kvcache.simulate import Simulation

CALIBRATED, SCALE_ONE, E5M2 = "calibrated (e4m3)", "scale 1.0 (e4m3)", "scale 1.0 (e5m2)"


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


def batches(samples: Samples, batch_size: int, pad_id: int) -> Iterator[tuple[Any, Any]]:
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


@dataclass
class _Tally:
    kl: list[Any] = field(default_factory=list)
    kl_rows: list[tuple[float, int]] = field(default_factory=list)  # per sample: sum, tokens
    top1: list[Any] = field(default_factory=list)
    nll: list[Any] = field(default_factory=list)
    nll_rows: list[tuple[float, int]] = field(default_factory=list)


def score(model, batch_list: list[tuple[Any, Any]],
          simulations: dict[str, Simulation | None],
          progress: Callable[[], None] = lambda: None, *,
          models: dict[str, Any] | None = None) -> tuple[float, dict[str, Metrics]]:
    """Reference perplexity (`model`, exact cache) and metrics of each simulation on the
    same batches; a configuration named in `models` runs that model instead (other weights
    against the same reference), with its simulation or, None, an exact cache."""
    import torch

    from kvcalib.kvcache import simulate

    tallies = {name: _Tally() for name in simulations}
    ref_nll = []
    with torch.no_grad():
        for tokens, mask in batch_list:
            with simulate.simulate(None):
                ref = torch.log_softmax(model(tokens, attention_mask=mask).logits[:, :-1].float(),
                                        -1)
            valid = mask[:, 1:].bool()
            targets = tokens[:, 1:].unsqueeze(-1)
            ref_nll.append(-ref.gather(-1, targets).squeeze(-1)[valid])
            ref_top = ref.argmax(-1)
            for name, sim in simulations.items():
                runs = (models or {}).get(name, model)
                with simulate.simulate(sim):
                    out = torch.log_softmax(
                        runs(tokens, attention_mask=mask).logits[:, :-1].float(), -1)
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


def _kl_interval(rows: list[tuple[float, int]]) -> tuple[float, float] | None:
    """95% bootstrap interval of the token-weighted mean KL over samples (None: too few)."""
    if stats.too_few(len(rows)):
        return None
    found = stats.bootstrap(np.array(rows, dtype=float), stats.ratio_of_sums)
    return found.low, found.high


def verdict(metrics: dict[str, Metrics]) -> str:
    """What calibration buys against scale 1.0, said plainly: a difference whose paired
    95% interval over the samples includes zero is within noise, however large it looks."""
    ours, unit = metrics[CALIBRATED], metrics[SCALE_ONE]
    both = f"mean KL {ours.mean_kl:.4g} calibrated vs {unit.mean_kl:.4g} at scale 1.0"
    if why := stats.too_few(len(ours.kl_by_sample)):
        return f"{both}; {why} samples: use --num-samples {stats.MIN_SAMPLES} or more to decide"
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


def difference(found: stats.Comparison) -> dict[str, Any]:
    d = found.difference
    return {"difference": d.estimate, "low": d.low, "high": d.high,
            "within_noise": found.within_noise, "samples": found.samples,
            "samples_needed": stats.samples_needed(found)}


def compare_to(reference: Metrics, other: Metrics) -> dict[str, Any] | None:
    """Mean KL and perplexity of `other` minus `reference`, with paired 95% intervals over
    the same samples; None with too few samples to tell."""
    if stats.too_few(len(reference.kl_by_sample)):
        return None
    return {"mean_kl": difference(stats.paired_bootstrap(
                reference.kl_pairs(), other.kl_pairs(), stats.ratio_of_sums)),
            "ppl": difference(stats.paired_bootstrap(
                reference.nll_pairs(), other.nll_pairs(), stats.perplexity))}


