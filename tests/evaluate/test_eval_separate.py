"""`kvcalib eval` on a weight-quantized checkpoint: weights only, KV only and both, each
against the unquantized model it was made from (kvcalib.evaluate.separate).

The checkpoint is a W8A8 SmolLM2 from one `run --scheme W8A8` pass. The weights-only row
is recomputed here without kvcalib: the unquantized model with its Linear weights replaced
by the stored int8 values times their scales (reference.dequantized_model) and its Linear
inputs quantized per token to int8, as the W8A8 scheme says, against the unquantized model,
on the same token ids. The KV-only row is the unquantized model evaluated on its own with
the checkpoint's scales through `--compare`. The held-out text is a file of the built-in
corpus' documents, so that no run leaves calibration rows out: every run scores the same
tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_error, kvcalib_run, linked_copy, run_kvcalib
from reference import _load, dequantized_model

# 12 samples: the fewest that eval draws intervals from (kvcalib.stats).
SAMPLES, TOKENS = 12, 32
WEIGHTS = "weights only (16-bit cache)"
KV = "KV only (unquantized weights, FP8 cache)"
BOTH = "both (quantized weights, FP8 cache)"
REPORT = "kvcalib_report.json"


@pytest.fixture(scope="module")
def w8a8(demo_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("w8a8") / "smol-w8a8"
    result = kvcalib_run(demo_model, out, "--scheme", "W8A8")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> list:
    from kvcalib.data import corpus

    texts = tmp_path_factory.mktemp("held-out") / "held-out.jsonl"
    texts.write_text("".join(json.dumps({"text": doc["text"]}) + "\n"
                             for doc in corpus.documents()[:2 * SAMPLES]))
    return ["--dataset", texts, "--num-samples", SAMPLES, "--max-seq-len", TOKENS,
            "--passkey-lengths", ""]


@pytest.fixture(scope="module")
def separate_run(w8a8, held_out, tmp_path_factory, fp8_kv_supported):
    """eval --engine with no --reference: the calibration report's input model is the
    reference. Without an FP8 KV cache in this machine's vLLM the engine rows that need
    one cannot run: exit 2, the simulated rows as ever."""
    out = tmp_path_factory.mktemp("eval-separate") / "eval.json"
    result = run_kvcalib("eval", w8a8, *held_out, "--engine", "--json", out, timeout=1800)
    assert result.returncode == (0 if fp8_kv_supported else 2), result.stderr[-3000:]
    return result, json.loads(out.read_text())


def _int8_inputs_per_token(module, args):
    """W8A8's dynamic activation quantization: symmetric int8 per token (compressed-tensors'
    scale: absmax / 127.5, the half-range of 256 codes)."""
    x = args[0]
    scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / 127.5
    return ((x / scale).round().clamp(-128, 127) * scale,)


def _held_out_ids(report: dict, held_out: list, demo_model) -> list[list[int]]:
    """The token ids eval scored (their digest is in its report)."""
    from transformers import AutoTokenizer

    from kvcalib.data import DatasetSpec, select_samples

    samples = select_samples(DatasetSpec(str(held_out[1])),
                             AutoTokenizer.from_pretrained(demo_model), SAMPLES, TOKENS, 0)
    assert samples.dataset["token_ids_sha256"] == report["samples"]["token_ids_sha256"]
    return samples.token_ids


def test_three_rows_against_the_unquantized_model(separate_run, demo_model):
    result, report = separate_run
    apart = report["separate"]
    assert apart["reference"] == str(demo_model.resolve())
    assert list(apart["rows"]) == [WEIGHTS, KV, BOTH]
    assert apart["fp8_cache"] == "calibrated (e4m3)"
    rows = {name: row["metrics"] for name, row in apart["rows"].items()}
    for name, m in rows.items():
        assert m["mean_kl"] > 0, name
        low, high = m["mean_kl_ci"]
        assert low <= m["mean_kl"] <= high
        ppl = apart["rows"][name]["vs_reference"]["ppl"]
        assert ppl["difference"] == pytest.approx(m["ppl"] - apart["reference_ppl"], rel=1e-4)
    assert rows[WEIGHTS]["clipped"] == {}  # no simulated cache: 16-bit
    assert set(rows[KV]["clipped"]) == {"k", "v"}
    # both: the checkpoint's weights with its FP8 cache (eval's own reference is the
    # checkpoint with a 16-bit cache, so its calibrated row measures the KV part there).
    assert rows[BOTH]["mean_kl"] > rows[WEIGHTS]["mean_kl"]
    w, kv, both = (rows[name]["kl_by_sample"] for name in (WEIGHTS, KV, BOTH))
    excess = (sum(b[0] for b in both) - sum(a[0] + c[0] for a, c in zip(w, kv, strict=True))
              ) / sum(b[1] for b in both)
    assert apart["interaction"]["difference"] == pytest.approx(excess, rel=1e-9, abs=1e-12)
    assert apart["interaction"]["low"] <= apart["interaction"]["difference"]
    assert "Weights and KV apart, against the unquantized model" in result.stdout
    assert f"Combined vs separate: {apart['verdict']}" in result.stdout
    assert "the reference is the calibration report's input model" in result.stdout


@torch.no_grad()
def test_weights_only_row_recomputed(separate_run, held_out, w8a8, demo_model):
    """KL(unquantized || W8A8) per token, with no kvcalib code and no KV simulation."""
    _, report = separate_run
    # eval runs transformers' sdpa attention. With int8 activations the choice shows: float
    # noise between attention kernels flips roundings (eager gives 1.3% more KL here).
    reference = _load(demo_model, "float32", "sdpa")
    quantized = dequantized_model(w8a8, demo_model, "float32")
    quantized.set_attn_implementation("sdpa")
    for name, module in quantized.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(_int8_inputs_per_token)
    total = tokens = 0.0
    for ids in _held_out_ids(report, held_out, demo_model):
        x = torch.tensor([ids])
        p = torch.log_softmax(reference(x).logits[0, :-1].float(), -1)
        q = torch.log_softmax(quantized(x).logits[0, :-1].float(), -1)
        total += float((p.exp() * (p - q)).sum())
        tokens += len(ids) - 1
    row = report["separate"]["rows"][WEIGHTS]["metrics"]
    assert row["mean_kl"] == pytest.approx(total / tokens, rel=1e-6)


def test_kv_only_row_is_the_unquantized_model_with_the_checkpoints_scales(
        separate_run, held_out, w8a8, demo_model, tmp_path):
    """The unquantized model evaluated on its own, with the checkpoint's scales as
    --compare, on the same held-out tokens."""
    _, report = separate_run
    out = tmp_path / "eval.json"
    result = run_kvcalib("eval", demo_model, *held_out, "--compare", w8a8, "--json", out,
                         timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    plain = json.loads(out.read_text())
    assert plain["samples"]["token_ids_sha256"] == report["samples"]["token_ids_sha256"]
    row = report["separate"]["rows"][KV]["metrics"]
    compared = plain["metrics"][f"compare: {w8a8.name} (compressed-tensors, e4m3)"]
    assert np.ravel(row["kl_by_sample"]) == pytest.approx(np.ravel(compared["kl_by_sample"]),
                                                          rel=1e-6)
    assert row["top1"] == compared["top1"]
    assert row["ppl"] == pytest.approx(compared["ppl"], rel=1e-6)
    assert report["separate"]["reference_ppl"] == pytest.approx(plain["reference_ppl"],
                                                                rel=1e-6)


@pytest.mark.engine
def test_the_three_rows_in_vllm(separate_run, w8a8, fp8_kv_supported):
    """The same rows in vLLM, on the same token ids. Each run is checked against what is
    independent of kvcalib's engine code: the scales vLLM's attention layers ran with in
    the KV-only and combined runs against the checkpoint's scale tensors, read here with
    safetensors (compressed-tensors would load missing ones as 1.0 without a word), and
    the simulated rows computed in transformers (the same model in bf16 instead of fp32:
    perplexities within 5%; 0.1-2.6% apart when this test was written)."""
    from safetensors import safe_open

    result, report = separate_run
    apart, engine = report["engine"]["separate"], report["engine"]
    # the checkpoint's own cross-check, fp8 against the model dtype
    assert engine["capacity"]["ratio"] == pytest.approx(2.0, abs=0.1)
    assert Path(engine["logs"]["fp8"]).name == "vllm-fp8.log"
    assert Path(engine["logs"]["bfloat16"]).exists()
    assert list(apart["rows"]) == [WEIGHTS, KV, BOTH]
    simulated = report["separate"]
    assert apart["reference"]["ppl"] == pytest.approx(simulated["reference_ppl"], rel=0.05)
    kv_log = engine["logs"]["kv-only"]
    assert kv_log.endswith("vllm-kv-only.log") and engine["logs"]["reference"]
    if not fp8_kv_supported:
        assert "cannot run an FP8 KV cache" in engine["error"]
        for name in (KV, BOTH):
            assert "FP8 KV cache" in apart["rows"][name]["error"], apart["rows"][name]
        assert any(c["message"].startswith("vLLM weights and KV apart: ")
                   for c in report["checks"])
        return
    assert engine["outputs"]["positions"] == SAMPLES * (TOKENS - 1)
    stored = {}
    for path in w8a8.glob("*.safetensors"):
        with safe_open(path, "pt") as tensors:
            names = [name for name in tensors.keys()  # noqa: SIM118 (not a dict)
                     if name.endswith(("k_scale", "v_scale"))]
            stored.update({name: float(tensors.get_tensor(name).float().max())
                           for name in names})
    assert len(stored) == 60
    for name in (KV, BOTH):
        loaded = apart["rows"][name]["loaded_scales"]
        assert len(loaded) == 30, name
        for layer, (k, v) in loaded.items():
            module = layer.removesuffix(".attn")  # model.layers.N.self_attn
            assert (k, v) == pytest.approx((stored[f"{module}.k_scale"],
                                            stored[f"{module}.v_scale"]), rel=1e-2), layer
    for name, row in apart["rows"].items():
        expected = simulated["rows"][name]["metrics"]["ppl"]
        assert row["ppl"] == pytest.approx(expected, rel=0.05), name
        assert row["ppl_change"] == pytest.approx(row["ppl"] / apart["reference"]["ppl"] - 1)
        interval = row["vs_reference"]["ppl"]
        assert interval["low"] <= interval["difference"] <= interval["high"]
        assert 0.5 < row["top1_agreement"] <= 1 and row["mean_abs_logprob_diff"] > 0
    assert {row["kv_cache_dtype"] for row in apart["rows"].values()} == {"bfloat16", "fp8"}
    assert apart["interaction"]["low"] <= apart["interaction"]["difference"]
    assert "In vLLM, against the unquantized model's run (bfloat16 cache" in result.stdout
    assert any(c["message"].startswith("vLLM perplexity change against the unquantized model: "
                                       "weights only") for c in report["checks"])


def test_no_unquantized_reference_is_said(w8a8, tmp_path):
    """The report's input model gone: a note naming --reference, and no rows."""
    copy = linked_copy(w8a8, tmp_path / "moved", leave_out=(REPORT,))
    calibration = json.loads((w8a8 / REPORT).read_text())
    calibration["model"]["path"] = str(tmp_path / "gone")
    (copy / REPORT).write_text(json.dumps(calibration))
    out = tmp_path / "eval.json"
    result = run_kvcalib("eval", copy, "--num-samples", 1, "--max-seq-len", 8,
                         "--passkey-lengths", "", "--json", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["separate"] is None
    assert (f"no unquantized reference: the calibration report's input model "
            f"{tmp_path / 'gone'} is not a folder") in result.stdout
    assert "pass --reference FOLDER" in result.stdout


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_no_output_inside_the_implicit_reference(option, w8a8, demo_model, tmp_path):
    """The report's input model is an input too when eval takes it as the reference:
    an output inside it (--json, and with it --engine's logs) is refused before any
    work, and nothing is written there."""
    model = linked_copy(demo_model, tmp_path / "model")
    copy = linked_copy(w8a8, tmp_path / "ckpt", leave_out=(REPORT,))
    calibration = json.loads((w8a8 / REPORT).read_text())
    calibration["model"]["path"] = str(model)
    (copy / REPORT).write_text(json.dumps(calibration))
    before = sorted(model.iterdir())
    result = run_kvcalib("eval", copy, option, model / "out", "--engine")
    assert_error(result, 2, f"is inside the input folder {model}")
    assert sorted(model.iterdir()) == before


def test_mismatched_reference_is_refused(w8a8, tiny_model):
    result = run_kvcalib("eval", w8a8, "--reference", tiny_model("llama"),
                         "--passkey-lengths", "")
    assert_error(result, 2, "is another model than smol-w8a8: hidden_size")


def test_reference_with_another_tokenizer_is_refused(w8a8, demo_model, tmp_path):
    """Same config and weights, one token renamed: found once both are loaded, before any
    scoring."""
    other = linked_copy(demo_model, tmp_path / "other", leave_out=("tokenizer.json",))
    text = (demo_model / "tokenizer.json").read_text()
    assert text.count('"<empty_output>"') == 2  # an added token, and in the vocabulary
    (other / "tokenizer.json").write_text(text.replace("<empty_output>", "<no_output>"))
    result = run_kvcalib("eval", w8a8, "--reference", other, "--num-samples", 1,
                         "--max-seq-len", 8, "--passkey-lengths", "")
    assert_error(result, 2, f"--reference {other} is not this checkpoint's model: its "
                 "tokenizer's vocabulary differs")


def test_reference_needs_quantized_weights(demo_model):
    result = run_kvcalib("eval", demo_model, "--reference", demo_model)
    assert_error(result, 2, "--reference is for weight-quantized checkpoints")
