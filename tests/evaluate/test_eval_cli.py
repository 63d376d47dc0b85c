"""`kvcalib eval` as users run it: table, JSON, plot, gates, KIVI, the engine cross-check."""

from __future__ import annotations

import json

import pytest

from conftest import SCALES, linked_copy, run_kvcalib

SMALL = ["--num-samples", 2, "--max-seq-len", 64, "--passkey-lengths", 256,
         "--passkey-depths", 0.5]


@pytest.fixture(scope="module")
def eval_run(smol_attn_head, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    result = run_kvcalib("eval", smol_attn_head, *SMALL, "--sweep", "--sweep-samples", 2,
                         "--kivi", "--kivi-group", 16, "--kivi-residual", 16,
                         "--max-kl", 1e-9, "--max-ppl-increase", 0.5, "--min-passkey", 0,
                         "--json", out / "eval.json", "--plot", out / "eval.png", timeout=1800)
    return result, json.loads((out / "eval.json").read_text()), out


def test_gates_and_exit_code(eval_run):
    result, report, _ = eval_run
    assert result.returncode == 1, result.stderr
    gates = [c for c in report["checks"] if c["group"] == "gate"]
    assert [g["status"] for g in gates] == ["fail", "pass", "pass"]
    assert gates[0]["message"].startswith("calibrated (e4m3): mean KL ")
    assert "Result: FAIL (exit code 1)" in result.stdout
    assert "Traceback" not in result.stderr


def test_table_json_and_kivi(eval_run):
    result, report, _ = eval_run
    metrics = report["metrics"]
    kivi = "kivi 2-bit (G=16, R=16)"
    assert set(metrics) == {"calibrated (e4m3)", "scale 1.0 (e4m3)", "scale 1.0 (e5m2)", kivi}
    assert metrics[kivi]["mean_kl"] > metrics["calibrated (e4m3)"]["mean_kl"]  # 2 bits < 8
    for line in ("calibrated (e4m3)", "scale 1.0 (e5m2)", kivi, "Passkey retrieval"):
        assert line in result.stdout
    # SmolLM2: C = 3 KV heads x 64 = 192 channels, 30 layers, 64-token samples, G = R = 16.
    # Keys: 3 groups x (16 x 48 B codes + 4 x 192 B scale/zero) + 16 exact x 192 x 2 B.
    # Values: 48 tokens x (48 B codes + 4 x 12 groups) + 16 exact x 192 x 2 B.
    keys = 3 * (16 * 48 + 4 * 192) + 16 * 192 * 2
    values = 48 * (48 + 4 * 12) + 16 * 192 * 2
    assert report["kivi"]["bytes_per_token"]["kivi"] == 30 * (keys + values) / 64
    assert report["kivi"]["bytes_per_token"]["fp8"] == 2 * 192 * 30
    assert report["kivi"]["bytes_per_token"]["16bit"] == 2 * 192 * 30 * 2


def test_sweep_and_plot(eval_run):
    _, report, out = eval_run
    sweep = report["sweep"]
    assert len(sweep["layers"]) == 30 and sweep["samples"] == 2
    # 2 samples give a paired bootstrap of 3 distinct resamples: no interval is drawn, no
    # layer is called noise or signal, and none is recommended (the budget binds here).
    assert sweep["too_few_samples"] == "too few samples to tell: 2 < 12"
    assert all(e["gain_interval"] is None and e["within_noise"] is None
               for e in sweep["layers"])
    assert sweep["within_noise"] == []
    assert sweep["recommendation"]["skip_layers"] == [] and not sweep["recommendation"]["met"]
    assert sweep["recommendation"]["flag"] == "(none: too few samples to tell: 2 < 12 samples)"
    png = (out / "eval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_bad_options(smol_attn_head):
    result = run_kvcalib("eval", smol_attn_head, "--rounding", "up")
    assert result.returncode == 2 and "'up' is not one of 'nearest', 'toward_zero'" in result.stderr
    result = run_kvcalib("eval", smol_attn_head, "--passkey-lengths", "long")
    assert result.returncode == 2 and "is not a comma-separated list" in result.stderr
    result = run_kvcalib("eval", smol_attn_head / "nope")
    assert result.returncode == 2 and "checkpoint folder not found" in result.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda r: "{not json", "kvcalib_report.json is not valid JSON"),
    (lambda r: json.dumps({**r, "schema_version": 99}), "has schema version 99"),
    (lambda r: json.dumps({k: v for k, v in r.items() if k != "dataset"}),
     "is not a kvcalib calibration report: dataset: Field required"),
])
def test_malformed_report_fails_before_loading(edit, message, smol_attn_head, tmp_path):
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    (ckpt / "kvcalib_report.json").write_text(edit(report))
    result = run_kvcalib("eval", ckpt, *SMALL)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("Error:")] == [
        next(line for line in result.stderr.splitlines() if message in line)]
    assert "Evaluating" not in result.stderr  # refused before the model loads


def test_report_cannot_choose_what_eval_reads(smol_attn_head, tmp_path):
    """A report naming a local file (or a hub dataset) does not make eval read it."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"text": "do not read " * 200}) + "\n")
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    report["dataset"]["source"] = str(secret)
    (ckpt / "kvcalib_report.json").write_text(json.dumps(report))
    result = run_kvcalib("eval", ckpt, *SMALL, "--passkey-lengths", "", "--json", "-")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["samples"]["source"] == "builtin"
    assert any("eval reads it only when named with --dataset" in n for n in shown["notes"])
    # Named explicitly, it is read.
    result = run_kvcalib("eval", ckpt, *SMALL, "--passkey-lengths", "", "--dataset", secret,
                         "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["samples"]["source"] == str(secret)


@pytest.mark.parametrize("value", [float("nan"), 0.0], ids=["nan", "zero"])
def test_compare_scales_are_validated_like_verify(value, smol_attn_head, tmp_path):
    from safetensors.torch import load_file, save_file

    scales = load_file(smol_attn_head / SCALES)
    scales["model.layers.4.self_attn.k_scale"].view(-1)[1] = value
    save_file(scales, tmp_path / "bad.safetensors")
    result = run_kvcalib("eval", smol_attn_head, *SMALL, "--compare", tmp_path / "bad.safetensors")
    assert result.returncode == 2, result.stderr
    assert "--compare" in result.stderr and "model.layers.4.self_attn.k_scale" in result.stderr
    assert "do not pass verify" in result.stderr


def test_exhausted_dataset_says_so(smol_attn_head, tmp_path):
    """Calibration used every row of a small dataset: eval says so and asks for --dataset."""
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    report["dataset"]["rows_used"] = list(range(report["dataset"]["num_rows"]))
    (ckpt / "kvcalib_report.json").write_text(json.dumps(report))
    result = run_kvcalib("eval", ckpt, *SMALL)
    assert result.returncode == 2, result.stderr
    assert "every usable row of dataset builtin was used for calibration" in result.stderr
    assert "pass --dataset" in result.stderr


