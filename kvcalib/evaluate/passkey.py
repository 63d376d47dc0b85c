"""Passkey retrieval: a pass key hidden at several depths of real text, asked for at the
end; does the model still find it with the cache quantized?"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from kvcalib.data import corpus
from kvcalib.errors import UsageError
from kvcalib.kvcache import simulate

PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


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
                simulation: simulate.Simulation | None,
                progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    import torch

    found = []
    for trial in trials:
        sim = simulation
        if sim is not None and sim.format is not None and sim.format.exact_first_chunk:
            # vLLM's first prefill chunk (the whole prompt here) attends to the exact K/V;
            # the generated tokens read the stored cache, prompt included.
            sim = dataclasses.replace(sim, exact_prefix=len(trial["ids"]))
        with torch.no_grad(), simulate.simulate(sim):
            ids = torch.tensor([trial["ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        found.append({"length": trial["length"], "depth": trial["depth"],
                      "correct": str(trial["key"]) in answer, "answer": answer.strip()})
        progress()
    return {"accuracy": sum(t["correct"] for t in found) / len(found), "trials": found}


