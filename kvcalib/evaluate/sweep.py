"""The per-layer sweep: which layers' FP8 cache costs the most, and the smallest skip set
that keeps mean KL within a budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcalib import stats
from kvcalib.evaluate.metrics import score
from kvcalib.kvcache import simulate


def sweep(model, batch_list, base: simulate.Simulation, layers: list[int],
          max_kl: float | None, progress: Callable[[], None]) -> dict[str, Any]:
    """KL with one layer quantized, and with all but one; then a greedy skip set.

    What skipping a layer saves is a paired difference over the sweep's samples: a layer
    whose 95% interval includes zero is marked within noise and never recommended. With
    fewer than stats.MIN_SAMPLES samples there are no intervals ("too_few_samples") and
    nothing is recommended."""

    def variant(only: set[int]) -> simulate.Simulation:
        return simulate.Simulation(fmt=base.fmt, rounding=base.rounding, scales=base.scales,
                                   kinds=base.kinds, layers=only)

    sims = {f"only {i}": variant({i}) for i in layers}
    sims.update({f"all but {i}": variant(set(layers) - {i}) for i in layers})
    sims["all"] = variant(set(layers))
    _, metrics = score(model, batch_list, sims, progress)
    full_kl = metrics["all"].mean_kl
    too_few = stats.too_few(len(metrics["all"].kl_by_sample))
    per_layer = []
    for i in layers:
        entry = {"layer": i, "only_kl": metrics[f"only {i}"].mean_kl,
                 "all_but_kl": metrics[f"all but {i}"].mean_kl,
                 "gain_if_skipped": full_kl - metrics[f"all but {i}"].mean_kl,
                 "gain_interval": None, "within_noise": None}
        if not too_few:  # all-but minus all: the saving is its negative
            saved = stats.paired_bootstrap(metrics["all"].kl_pairs(),
                                           metrics[f"all but {i}"].kl_pairs(),
                                           stats.ratio_of_sums).difference
            entry.update(gain_interval=[-saved.high, -saved.low],
                         within_noise=not saved.excludes_zero)
        per_layer.append(entry)
    ranking = sorted(per_layer, key=lambda e: (-e["gain_if_skipped"], -e["only_kl"]))
    result: dict[str, Any] = {"all_kl": full_kl, "layers": per_layer,
                              "ranking": [e["layer"] for e in ranking],
                              "too_few_samples": too_few,
                              "within_noise": [e["layer"] for e in per_layer
                                               if e["within_noise"]]}
    if max_kl is not None and too_few:
        result["recommendation"] = {"max_kl": max_kl, "skip_layers": [], "kl": full_kl,
                                    "met": full_kl <= max_kl,
                                    "flag": "(none needed)" if full_kl <= max_kl
                                    else f"(none: {too_few} samples)"}
    elif max_kl is not None:
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


