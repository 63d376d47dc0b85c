"""`eval` on the real SmolLM2: reproducible metrics, a skip set that keeps its budget,
and calibration that pays off where activations leave E4M3's range."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import peers
from conftest import run_kvcalib
from kvcalib.data import DatasetSpec, select_samples
from kvcalib.errors import UsageError
from kvcalib.evaluate import (
    CALIBRATED,
    E5M2,
    SCALE_ONE,
    EvalOptions,
    Gates,
    HeldOut,
    LayerSweep,
    SimulationOptions,
    evaluate,
)
from kvcalib.stats import MIN_SAMPLES

# the fewest samples that give intervals (kvcalib.stats)
SMALL = HeldOut(num_samples=MIN_SAMPLES, max_seq_len=96)
ONE_SAMPLE = HeldOut(num_samples=1, max_seq_len=48)


@pytest.fixture(scope="module")
def smol_eval(smol_attn_head):
    return evaluate(smol_attn_head, EvalOptions(SMALL), log=lambda _: None)


def test_metrics_are_reproducible_and_ordered(smol_eval, smol_attn_head):
    again = evaluate(smol_attn_head, EvalOptions(SMALL), log=lambda _: None)
    assert again.metrics == smol_eval.metrics
    m = smol_eval.metrics
    assert set(m) == {CALIBRATED, SCALE_ONE, E5M2}
    assert m[E5M2].mean_kl > 2 * m[SCALE_ONE].mean_kl  # E5M2 has one mantissa bit less
    for metrics in m.values():
        assert 0 < metrics.mean_kl < metrics.p99_kl and 0.8 < metrics.top1 <= 1
    assert smol_eval.samples["excluded_calibration_rows"] == 6  # the rows calibration used
    assert smol_eval.samples["count"] == MIN_SAMPLES
    for metrics in m.values():  # the per-sample sums are the tokens' KL, regrouped
        sums = metrics.kl_pairs()
        assert sums[:, 1].sum() == smol_eval.samples["tokens"] - len(sums)
        assert sums[:, 0].sum() / sums[:, 1].sum() == pytest.approx(metrics.mean_kl, rel=1e-9)
        low, high = metrics.mean_kl_ci
        assert low <= metrics.mean_kl <= high
    # SmolLM2's K/V lie inside E4M3's range: what calibration gains over scale 1.0 is
    # smaller than the spread over the samples on some CPUs and not on others; the verdict
    # must follow an independent paired bootstrap of the per-sample differences.
    ours, unit = m[CALIBRATED].kl_pairs(), m[SCALE_ONE].kl_pairs()
    rng = np.random.default_rng(1)
    diffs = []
    for _ in range(4000):
        i = rng.integers(0, len(ours), len(ours))
        diffs.append(unit[i, 0].sum() / unit[i, 1].sum() - ours[i, 0].sum() / ours[i, 1].sum())
    low, high = np.quantile(diffs, [0.025, 0.975])
    if low > 1e-3 * unit[:, 0].sum() / unit[:, 1].sum():  # clearly apart
        assert any(word in smol_eval.verdict for word in ("lower mean KL", "cut mean KL")), \
            smol_eval.verdict
    elif low < 0 < high and min(-low, high) > 0.05 * (high - low):  # clearly includes 0
        assert "gains nothing measurable (within noise)" in smol_eval.verdict, smol_eval.verdict
    assert "95% interval of the difference" in smol_eval.verdict


def hooked_kl(model_dir, token_ids, quantizers) -> float:
    """Mean token KL with K/V replaced through compressed-tensors' own hook points:
    quantizers maps a layer to (key function, value function) of (batch, heads, seq, dim)
    states; other layers stay exact."""
    from compressed_tensors.modeling import (
        initialize_hooked_kv_cache,
        register_key_hook,
        register_value_hook,
    )

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [torch.tensor([t]) for t in token_ids]
    with torch.no_grad():
        ref = [torch.log_softmax(model(t).logits[0, :-1], -1) for t in ids]
    for layer, (keys, values) in quantizers.items():
        attention = model.model.layers[layer].self_attn
        initialize_hooked_kv_cache(model, attention)
        register_key_hook(attention, lambda _m, x, f=keys: f(x))
        register_value_hook(attention, lambda _m, x, f=values: f(x))
    kls = []
    with torch.no_grad():
        for t, r in zip(ids, ref, strict=True):
            out = torch.log_softmax(model(t).logits[0, :-1], -1)
            kls.append((r.exp() * (r - out)).sum(-1))
    return float(torch.cat(kls).mean())


def _independent_kl(model_dir, token_ids, scales, skip: set[int]) -> float:
    """FP8 K/V through compressed-tensors' own hook points and torch's FP8 cast."""

    def quantizer(scale):
        s = scale.reshape(1, -1, 1, 1)
        return lambda x: ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s)

    return hooked_kl(model_dir, token_ids, {
        layer: (quantizer(scales[f"model.layers.{layer}.self_attn.k_scale"]),
                quantizer(scales[f"model.layers.{layer}.self_attn.v_scale"]))
        for layer in range(30) if layer not in skip})


def test_skip_set_keeps_its_kl_budget(smol_attn_head, demo_model):
    budget = 0.006  # all layers give about 0.0073 on these samples: a skip set is needed
    result = evaluate(smol_attn_head, EvalOptions(
                          HeldOut(num_samples=MIN_SAMPLES, max_seq_len=32,
                                  batch_size=MIN_SAMPLES),
                          layer_sweep=LayerSweep(sweep=True, samples=MIN_SAMPLES),
                          gates=Gates(max_kl=budget)),
                      log=lambda _: None)
    sweep = result.sweep
    assert sweep["all_kl"] > budget  # the budget binds: some layers must be skipped
    rec = sweep["recommendation"]
    # Only layers whose saving is told apart from noise over the samples are skipped:
    # the budget is met with them, or the recommendation says it is not.
    noise = {e["layer"] for e in sweep["layers"] if e["within_noise"]}
    assert rec["skip_layers"] and not noise & set(rec["skip_layers"])
    assert rec["met"] == (rec["kl"] <= budget)
    assert rec["flag"] == "--kv-cache-dtype-skip-layers " + " ".join(map(str, rec["skip_layers"]))
    assert len(sweep["ranking"]) == 30 and sorted(sweep["ranking"]) == list(range(30))
    # Recompute both KLs independently, on the same held-out tokens.
    from transformers import AutoTokenizer

    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    samples = select_samples(DatasetSpec("builtin"), AutoTokenizer.from_pretrained(demo_model),
                             MIN_SAMPLES, 32, 0, exclude_rows=set(report["dataset"]["rows_used"]))
    assert samples.digest() == result.samples["token_ids_sha256"]
    scales = {k: v.float().flatten() for k, v in load_file(
        smol_attn_head / "kv_scales.safetensors").items()}
    full = _independent_kl(demo_model, samples.token_ids, scales, set())
    skipped = _independent_kl(demo_model, samples.token_ids, scales, set(rec["skip_layers"]))
    assert full == pytest.approx(sweep["all_kl"], rel=0.02)
    assert skipped == pytest.approx(rec["kl"], rel=0.02) and skipped < full


def _rescaled(demo_model, tmp_path, name: str, factor: float) -> object:
    """SmolLM2 with K (or V) scaled by `factor` and Q (or O) by 1/factor: same function.

    Powers of two are exact in bf16, so the model computes exactly the same logits.
    """
    out = tmp_path / name
    shutil.copytree(demo_model, out)
    weights = load_file(out / "model.safetensors")
    for layer in range(30):
        p = f"model.layers.{layer}.self_attn"
        if name == "big-keys":
            weights[f"{p}.k_proj.weight"] *= factor
            weights[f"{p}.q_proj.weight"] /= factor
        else:
            weights[f"{p}.v_proj.weight"] *= factor
            weights[f"{p}.o_proj.weight"] /= factor
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name, factor", [("big-keys", 64.0), ("tiny-values", 2.0**-12)])
def test_calibration_pays_off_outside_e4m3_range(name, factor, demo_model, tmp_path):
    model = _rescaled(demo_model, tmp_path, name, factor)
    ckpt = tmp_path / f"{name}-fp8"
    result = run_kvcalib("run", "--model", model, "--output", ckpt, "--dataset", "builtin",
                         "--num-samples", 6, "--max-seq-len", 128)
    assert result.returncode == 0, result.stderr
    ev = evaluate(ckpt, EvalOptions(SMALL), log=lambda _: None)
    calibrated, unit = ev.metrics[CALIBRATED], ev.metrics[SCALE_ONE]
    assert calibrated.mean_kl * 10 <= unit.mean_kl, (calibrated, unit)
    assert "calibrated scales cut mean KL" in ev.verdict
    if name == "big-keys":
        assert unit.clipped["k"] > 0.01  # scale 1.0 clips keys beyond 448
    # The rescaled model computes the same function as the original (same tokens: neither
    # folder has a calibration report to exclude rows by).
    rescaled = evaluate(model, EvalOptions(ONE_SAMPLE), log=lambda _: None)
    plain = evaluate(demo_model, EvalOptions(ONE_SAMPLE), log=lambda _: None)
    assert rescaled.samples["token_ids_sha256"] == plain.samples["token_ids_sha256"]
    assert rescaled.reference_ppl == pytest.approx(plain.reference_ppl, rel=1e-4)


def test_checkpoint_without_scales_evaluates_baselines(demo_model):
    result = evaluate(demo_model, EvalOptions(ONE_SAMPLE), log=lambda _: None)
    assert set(result.metrics) == {SCALE_ONE, E5M2}
    assert any("own scales are not evaluated" in note and "no KV-cache quantization" in note
               for note in result.notes)
    assert result.exit_code == 0


def test_mismatched_tokenizer_and_model(tiny_model, tmp_path):
    import transformers as tf

    folder = tmp_path / "small-vocab"
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model("llama") / name, folder / name)
    with pytest.raises(UsageError, match="tokenizer has 49152 tokens but the model's "
                                         "embedding only 1000"):
        evaluate(folder, EvalOptions(HeldOut(num_samples=1, max_seq_len=16)),
                 log=lambda _: None)


def test_compare_with_another_models_scales_is_refused(smol_attn_head, tiny_model, tmp_path):
    other = tmp_path / "other"
    result = run_kvcalib("run", "--model", tiny_model("llama"), "--output", other, "--dataset",
                         "builtin", "--num-samples", 1, "--max-seq-len", 16)
    assert result.returncode == 0, result.stderr
    with pytest.raises(UsageError, match="scales are for another model shape"):
        evaluate(smol_attn_head, EvalOptions(HeldOut(num_samples=1, max_seq_len=16),
                                             SimulationOptions(compare=other)),
                 log=lambda _: None)


def test_compare_with_a_peer_checkpoint_folder(smol_attn_head, tmp_path):
    """A real Quark export (which vLLM 0.32 refuses to load) as --compare: its scales are
    simulated all the same, the row names its folder and layout, and the notes say that
    they were measured before RoPE and merged."""
    quark = peers.materialize("quark-kv", tmp_path / "quark-kv")
    result = evaluate(smol_attn_head, EvalOptions(HeldOut(num_samples=1, max_seq_len=96),
                                                  SimulationOptions(compare=quark)),
                      log=lambda _: None)
    compared = result.metrics["compare: quark-kv (quark, e4m3)"]
    assert 0 < compared.mean_kl != result.metrics[CALIBRATED].mean_kl
    notes = [n for n in result.notes if n.startswith("--compare quark-kv: ")]
    assert len(notes) == 2 and "before RoPE" in notes[0] and "merged" in notes[1]


def test_compare_with_a_scales_file(smol_attn_head, tmp_path):
    """Halved scales (a scales file): clipping appears, and is counted."""
    halved = {k: v / 2 for k, v in load_file(smol_attn_head / "kv_scales.safetensors").items()}
    save_file(halved, tmp_path / "halved.safetensors")
    result = evaluate(smol_attn_head, EvalOptions(
                          HeldOut(num_samples=1, max_seq_len=96),
                          SimulationOptions(compare=tmp_path / "halved.safetensors")),
                      log=lambda _: None)
    compared = result.metrics["compare: halved.safetensors (scales file, e4m3)"]
    assert compared.clipped["k"] > 0.005 > result.metrics[CALIBRATED].clipped["k"]
    save_file({"model.layers.0.self_attn.k_scale": halved["model.layers.0.self_attn.k_scale"]},
              tmp_path / "one.safetensors")
    with pytest.raises(UsageError, match="do not pass verify: layer 0: no v_scale tensor"):
        one = SimulationOptions(compare=tmp_path / "one.safetensors")
        evaluate(smol_attn_head, EvalOptions(HeldOut(num_samples=1, max_seq_len=16), one),
                 log=lambda _: None)
