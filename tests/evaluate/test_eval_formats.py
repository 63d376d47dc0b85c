"""`eval --formats`: every vLLM KV format on the real SmolLM2, sized by hand from vLLM's
page accounting, its KL recomputed through an independent hook path, ranked with paired
intervals, filtered by target, and a recommendation that follows the gates."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from test_eval import hooked_kl
from transformers import AutoTokenizer

from conftest import SCALES, assert_error, run_kvcalib
from kvcalib.checkpoint import open_checkpoint
from kvcalib.data import DatasetSpec, select_samples
from kvcalib.evaluate import CALIBRATED, EvalOptions, Formats, Gates, HeldOut, evaluate
from kvcalib.evaluate.format_comparison import FormatRow, meets_gates, nvfp4_scales, recommend
from kvcalib.evaluate.format_comparison import format_names as names_for
from kvcalib.evaluate.summary import eval_summary
from kvcalib.kvcache import quantize as kvquant
from kvcalib.stats import MIN_SAMPLES

FORMATS = ["int8_per_token_head", "turboquant_k8v4", "nvfp4", "fp8_e5m2"]
GIB = 2**30
BLOCK = 16


def tokens_in(budget: int, bytes_per_token: int) -> int:
    """Whole blocks of 16 tokens that fit (vLLM's allocation)."""
    return budget // (BLOCK * bytes_per_token) * BLOCK


@pytest.fixture(scope="module")
def formats_eval(smol_attn_head):
    return evaluate(smol_attn_head, EvalOptions(HeldOut(num_samples=MIN_SAMPLES, max_seq_len=48),
                                                formats=Formats(FORMATS, budget="1GiB")),
                    log=lambda _: None)


def _rows(result) -> dict[str, dict]:
    return {row["label"]: row for row in result.formats["rows"]}


def test_rows_and_tokens_at_the_budget(formats_eval):
    rows = _rows(formats_eval)
    assert list(rows) == ["auto", "fp8 (calibrated)", "fp8 (scale 1.0)", "int8_per_token_head",
                          "turboquant_k8v4", "nvfp4 (calibrated)", "nvfp4 (scale 1.0)",
                          "fp8_e5m2 (calibrated)", "fp8_e5m2 (scale 1.0)"]
    # SmolLM2: 30 layers, 3 KV heads of 64, bf16. Bytes per token over all layers:
    dense = 2 * 3 * 64  # K and V elements per layer
    slot_k8v4 = 64 + 64 * 4 // 8 + 4  # fp8 key, 4-bit values, fp16 scale and min: 100
    expected = {
        "auto": 30 * dense * 2,
        "fp8 (calibrated)": 30 * dense,
        "int8_per_token_head": 30 * 3 * (2 * 64 + 2 * 4),  # inline fp32 scale per head
        "turboquant_k8v4": 4 * dense * 2 + 26 * 3 * slot_k8v4,  # layers 0, 1, 28, 29 bf16
        "nvfp4 (calibrated)": 30 * 2 * 3 * (64 // 2 + 64 // 16),  # FP4 + E4M3 per 16
        "fp8_e5m2 (scale 1.0)": 30 * dense,
    }
    for label, per_token in expected.items():
        assert rows[label]["bytes_per_token"] == per_token, label
        assert rows[label]["tokens_at_budget"] == tokens_in(GIB, per_token), label
    assert "keeps layers 0-1, 28-29" in rows["turboquant_k8v4"]["note"]
    assert rows["fp8 (calibrated)"]["metrics_key"] == CALIBRATED  # scored once
    assert rows["fp8_e5m2 (scale 1.0)"]["metrics_key"] == "scale 1.0 (e5m2)"
    assert rows["auto"]["metrics_key"] is None and rows["auto"]["vs_reference"] is None
    json.loads(json.dumps(formats_eval.to_dict()))  # the JSON holds all of it


def test_kl_matches_an_independent_hook_path(formats_eval, smol_attn_head, demo_model):
    """int8 per token and head written out here; turboquant_k8v4 from kvquant, on the
    layers vLLM quantizes (not its first and last two), through compressed-tensors' hooks."""
    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    samples = select_samples(DatasetSpec("builtin"), AutoTokenizer.from_pretrained(demo_model),
                             MIN_SAMPLES, 48, 0, exclude_rows=set(report["dataset"]["rows_used"]))
    assert samples.digest() == formats_eval.samples["token_ids_sha256"]

    def int8(x):  # as _reshape_cache_per_token_head: times the reciprocal (x / scale moves
        # enough codes across a rounding edge to shift this small KL by 2%)
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-6)
        y = x * (1.0 / scale)
        return torch.where(y >= 0, y + 0.5, y - 0.5).trunc().clamp(-128, 127) * scale

    int8_kl = hooked_kl(demo_model, samples.token_ids, {i: (int8, int8) for i in range(30)})
    k8v4_kl = hooked_kl(demo_model, samples.token_ids, {
        i: (kvquant.turboquant_fp8_keys, lambda x: kvquant.turboquant_values(x, 4))
        for i in range(2, 28)})
    m = formats_eval.metrics
    assert m["int8_per_token_head"].mean_kl == pytest.approx(int8_kl, rel=1e-3)
    assert m["turboquant_k8v4"].mean_kl == pytest.approx(k8v4_kl, rel=0.02)


def test_nvfp4_global_scales_are_absmax_based(smol_attn_head, formats_eval):
    """ModelOpt's amax / (6 x 448) (four-over-six: / (6 x 256)); the FP8 scale is amax / 448."""
    ckpt, _ = open_checkpoint(smol_attn_head)
    files = load_file(smol_attn_head / SCALES)
    for fmt, ceiling in (("nvfp4", 448), ("nvfp4_4over6", 256)):
        got = nvfp4_scales(ckpt.scales.to_torch(), fmt)
        for layer in (0, 17):
            fp8 = files[f"model.layers.{layer}.self_attn.k_scale"].float().max()
            assert float(got[layer]["k"]) == pytest.approx(float(fp8) * 448 / (6 * ceiling))
    m = formats_eval.metrics
    assert m["nvfp4 (calibrated)"].mean_kl != m["nvfp4 (scale 1.0)"].mean_kl
    assert m["nvfp4 (calibrated)"].mean_kl > m["int8_per_token_head"].mean_kl  # 4 bits < 8


def test_differences_have_paired_intervals(formats_eval):
    m = formats_eval.metrics
    reference = m[CALIBRATED]
    for row in formats_eval.formats["rows"]:
        if row["metrics_key"] in (None, CALIBRATED):
            continue
        kl = row["vs_reference"]["mean_kl"]
        assert kl["difference"] == pytest.approx(m[row["metrics_key"]].mean_kl
                                                 - reference.mean_kl, rel=1e-9)
        assert kl["low"] <= kl["difference"] <= kl["high"]
        assert kl["within_noise"] == (kl["low"] <= 0 <= kl["high"]) and kl["samples"] == MIN_SAMPLES
        ppl = row["vs_reference"]["ppl"]
        assert ppl["difference"] == pytest.approx(m[row["metrics_key"]].ppl - reference.ppl,
                                                  rel=1e-6)
    two = formats_eval.formats["top_two"]
    scored = sorted({row["metrics_key"] for row in formats_eval.formats["rows"]
                     if row["metrics_key"]}, key=lambda key: m[key].mean_kl)
    labels = {row["metrics_key"]: row["label"] for row in formats_eval.formats["rows"]}
    assert (two["first"], two["second"]) == (labels[scored[0]], labels[scored[1]])
    assert two["samples_needed"] >= 2
    text = eval_summary(formats_eval)
    assert "Most accurate: " + two["first"] in text
    assert ("within noise" if two["within_noise"] else " beats ") in text


def test_recommendation_follows_the_gates(formats_eval):
    """For every KL threshold at a row's own KL: the recommendation is the most tokens
    among the rows at or below it (the model dtype always qualifies)."""
    m = formats_eval.metrics
    rows = [FormatRow(**row) for row in formats_eval.formats["rows"]]
    kl = {row.label: m[row.metrics_key].mean_kl if row.metrics_key else 0.0 for row in rows}
    for threshold in sorted(set(kl.values())):
        gated = [dataclasses.replace(row, meets_gates=meets_gates(row, m, None,
                                                                    Gates(max_kl=threshold)))
                 for row in rows]
        allowed = [row for row in rows if kl[row.label] <= threshold]
        most = max(row.tokens_at_budget for row in allowed)
        best = recommend(gated, m)
        assert best.tokens_at_budget == most
        assert kl[best.label] == min(kl[row.label] for row in allowed
                                     if row.tokens_at_budget == most)
    # The perplexity gate: each row on its own perplexity change (the model dtype's is 0).
    changes = {row.label: m[row.metrics_key].ppl_change if row.metrics_key else 0.0
               for row in rows}
    limit = sorted(changes.values())[len(changes) // 2]
    for row in rows:
        gated = meets_gates(row, m, None, Gates(max_ppl_increase=limit))
        assert gated == (changes[row.label] <= limit)
    # A passkey gate without passkey results fails every row; no gate: no recommendation.
    assert not any(meets_gates(row, m, None, Gates(min_passkey=0.5)) for row in rows)
    assert recommend(rows, m) is None


def test_target_filters_and_names_what_hardware_runs():
    def format_names(names: list[str], target: str | None) -> list[str]:
        return names_for(Formats(names, target))

    assert format_names(["all"], "cpu-avx512") == ["auto", "fp8", "fp8_e5m2"]
    assert format_names(["all"], "cpu-avx2") == ["auto"]
    assert "ultraquant_4bit" not in format_names(["all"], "h100")
    assert "ultraquant_4bit" in format_names(["all"], "mi300")
    assert format_names(["nvfp4_4over6", "fp8"], "b200") == ["auto", "fp8", "nvfp4_4over6"]
    assert "fp8_e4m3" not in format_names(["all"], None)  # an alias of fp8


def test_cli_target_na_note_gates_and_pareto(smol_attn_head, tmp_path):
    result = run_kvcalib("eval", smol_attn_head, "--formats",
                         "nvfp4,ultraquant_4bit,int8_per_token_head", "--target", "h100",
                         "--num-samples", 2, "--max-seq-len", 32, "--passkey-lengths", 128,
                         "--passkey-depths", 0.5, "--max-kl", 1e-9, "--budget", "2GiB",
                         "--json", tmp_path / "e.json", "--pareto", tmp_path / "p.png")
    assert result.returncode == 1, result.stderr  # nothing quantized has KL <= 1e-9
    report = json.loads((tmp_path / "e.json").read_text())
    rows = {row["label"]: row for row in report["formats"]["rows"]}
    assert set(rows) == {"auto", "fp8 (calibrated)", "fp8 (scale 1.0)", "nvfp4",
                         "int8_per_token_head"}  # not ultraquant_4bit: ROCm only
    assert rows["nvfp4"]["note"].startswith("n/a: FlashInfer's fa2 prefill misreads an "
                                            "NVFP4 cache at head size 64")
    assert rows["nvfp4"]["metrics_key"] is None and rows["nvfp4"]["meets_gates"] is None
    assert rows["int8_per_token_head"]["runs_on"]["h100"] == "TRITON_ATTN"
    assert rows["int8_per_token_head"]["tokens_at_budget"] == tokens_in(2 * GIB, 12240)
    assert rows["auto"]["passkey"] == report["passkey"]["reference"]["accuracy"]
    assert rows["int8_per_token_head"]["passkey"] == (
        report["passkey"]["int8_per_token_head"]["accuracy"])
    assert report["formats"]["recommendation"]["label"] == "auto"
    assert report["samples"]["rounding"] == "nearest"  # h100 rounds to nearest
    assert "no quantized format meets --max-kl 1e-09; keep --kv-cache-dtype auto" in result.stdout
    assert "nvfp4: n/a: FlashInfer" in result.stdout
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.parametrize("args, message", [
    (["--formats", "fp8,fp4"], "unknown format 'fp4'; valid: all, auto, fp8, fp8_e4m3"),
    (["--formats", "all", "--target", "a100"], "unknown --target 'a100'; valid: h100, b200"),
    (["--target", "h100"], "--target needs --formats"),
    (["--sweep", "--num-samples", 1], "--sweep needs at least 2 samples"),
])
def test_bad_format_options_are_usage_errors(args, message, smol_attn_head):
    assert_error(run_kvcalib("eval", smol_attn_head, *args), 2, message)
