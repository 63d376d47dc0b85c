"""`kvcalib card`: the model card, read back with huggingface_hub, against the report and
result JSON it was made from (expected values are taken from those inputs here, never
from kvcalib's output); updates leave the rest of a README as it was; links are not
written through; bad input is refused."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from conftest import ROOT, assert_error, run_kvcalib
from tiny_files import CONFIG, kv_checkpoint, valid_report

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
OURS = ["kvcalib", "fp8", "kv-cache", "compressed-tensors"]
BEGIN, END = "<!-- kvcalib:begin -->", "<!-- kvcalib:end -->"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A checkpoint whose report says `run` downloaded its input from the Hub."""
    folder = tmp_path / "smol-fp8"
    folder.mkdir()
    report = valid_report(4)
    report["model"].update(source=HUB_ID, path="/hf/hub/models--HuggingFaceTB--SmolLM2-135M-"
                                               "Instruct/snapshots/0123abcd")
    report["dataset"]["token_ids_sha256"] = hashlib.sha256(b"tokens").hexdigest()
    report["versions"] = {"llmcompressor": "0.14.0.1", "torch": "2.13.0+cpu"}
    (folder / "kvcalib_report.json").write_text(json.dumps(report))
    return folder


def card(*args: object) -> str:
    result = run_kvcalib("card", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def eval_json(tmp_path: Path, **extra: object) -> Path:
    """Eval's JSON as `kvcalib eval --sweep --max-kl 0.01 --json` writes it, cut down to
    what the card reads."""
    data = {
        "command": "kvcalib eval ckpt --sweep --max-kl 0.01 --json e.json",
        "checkpoint": "ckpt", "reference_ppl": 13.71,
        "samples": {"source": "builtin", "count": 12, "tokens": 1536, "max_seq_len": 128,
                    "excluded_calibration_rows": 6, "dtype": "float32", "rounding": "nearest",
                    "seconds": 60},
        "metrics": {"calibrated (e4m3)": {
            "mean_kl": 0.0123456, "p99_kl": 0.05, "top1": 0.95, "ppl": 13.8,
            "ppl_change": 0.0071, "clipped": {"k": 0.0, "v": 0.0001}, "kl_by_sample": [],
            "mean_kl_ci": [0.01, 0.015], "nll_by_sample": []}},
        "sweep": {"recommendation": {"max_kl": 0.01, "skip_layers": [3, 7], "kl": 0.009,
                                     "met": True, "flag": "--kv-cache-dtype-skip-layers 3 7"}},
        "checks": [{"group": "gate", "status": "pass", "message": "mean KL 0.01 <= 0.02",
                    "layer": None, "tensor": None, "value": 0.01}],
        "exit_code": 0, **extra}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(data))
    return path


def test_front_matter_and_provenance_read_back(ckpt):
    report = json.loads((ckpt / "kvcalib_report.json").read_text())
    card(ckpt)
    loaded = ModelCard.load(ckpt / "README.md")
    assert loaded.data.base_model == HUB_ID  # the report's input model, a hub download
    assert loaded.data.to_dict()["base_model_relation"] == "quantized"
    assert loaded.data.library_name == "vllm"
    assert loaded.data.tags == OURS
    text = loaded.text
    assert f"`{report['dataset']['token_ids_sha256']}`" in text
    assert "2 × ≤ 128 tokens (256 tokens)" in text  # samples used, max_seq_len, tokens
    assert "| observer | static_minmax |" in text
    assert "strategy attn_head" in text
    assert "llmcompressor 0.14.0.1, torch 2.13.0+cpu" in text
    assert "vllm serve smol-fp8 --kv-cache-dtype fp8\n" in text  # no skip layers made up


def test_where_it_serves_section(tmp_path):
    """Every serving target's verdict for the checkpoint's own scheme, the engine's reason
    beside each that does not serve the scales, and the fix for per-head scales."""
    from kvcalib.engine.targets import TARGETS

    folder = kv_checkpoint(tmp_path / "heads", "attn_head")
    (folder / "kvcalib_report.json").write_text(json.dumps(valid_report(2)))
    text = card(folder, "--print")
    section = text.split("## Where it serves", 1)[1].split(END, 1)[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| target")}
    assert set(rows) == set(TARGETS)
    assert "**serves**" in rows["vllm-hopper"]
    assert "**refuses**" in rows["vllm-ampere"]
    assert "per-head quant scales not supported" in rows["vllm-ampere"]
    assert "**scale 1.0**" in rows["sglang-hopper"]
    assert "kvcalib convert CKPT --strategy tensor" in section


def test_eval_table_command_and_skip_layers(ckpt, tmp_path):
    folder_mtime = ckpt.stat().st_mtime_ns
    text = card(ckpt, "--eval", eval_json(tmp_path), "--name", "org/smol-fp8", "--print")
    assert "vllm serve org/smol-fp8 --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 3 7\n" \
        in text
    # mean KL to 5 places, its interval, top-1 and the perplexity change, from the JSON
    assert ("| calibrated (e4m3) | 0.01235 | 0.01000-0.01500 | 0.0500 | 95.00% | 13.8000 | "
            "+0.71% | 0.000% | 0.010% | - |") in text
    assert "| gate | pass | mean KL 0.01 <= 0.02 |" in text
    assert "Produced by: `kvcalib eval ckpt --sweep --max-kl 0.01 --json e.json`" in text
    assert ckpt.stat().st_mtime_ns == folder_mtime  # --print writes nothing, not even a probe


def _metrics(kl: float, ppl: float) -> dict:
    return {"mean_kl": kl, "p99_kl": 4 * kl, "top1": 0.9, "ppl": ppl, "ppl_change": 0.0,
            "clipped": {}, "kl_by_sample": [], "mean_kl_ci": [kl / 2, 2 * kl],
            "nll_by_sample": []}


def test_weights_and_kv_apart_tables(ckpt, tmp_path):
    """A W8A8 checkpoint's eval: the simulated rows and the same rows in vLLM."""
    rows = {"weights only (16-bit cache)": (0.0332, 18.7771, "bfloat16", 18.81),
            "KV only (unquantized weights, FP8 cache)": (0.0083, 18.4957, "fp8", 18.52),
            "both (quantized weights, FP8 cache)": (0.0423, 19.0574, "fp8", 19.16)}
    interval = {"difference": 0.5, "low": 0.2, "high": 0.8, "within_noise": False,
                "samples": 16, "samples_needed": 10}
    separate = {"reference": "/models/smol", "fp8_cache": "calibrated (e4m3)",
                "reference_ppl": 18.3679, "verdict": "the errors add up",
                "rows": {name: {"metrics": _metrics(kl, ppl), "vs_reference": None}
                         for name, (kl, ppl, _, _) in rows.items()}}
    engine = {"reference": {"kv_cache_dtype": "bfloat16", "ppl": 18.40},
              "rows": {name: {"kv_cache_dtype": dtype, "ppl": ppl, "ppl_change": ppl / 18.40 - 1,
                              "top1_agreement": 0.9, "mean_abs_logprob_diff": 0.1,
                              "vs_reference": {"ppl": interval}}
                       for name, (_, _, dtype, ppl) in rows.items()},
              "interaction": interval}
    text = card(ckpt, "--eval", eval_json(tmp_path, separate=separate,
                                          engine={"separate": engine}), "--print")
    assert "Weights and KV apart, against the unquantized model /models/smol" in text
    assert "| KV only (unquantized weights, FP8 cache) | 0.00830 | [0.00415, 0.01660] |" in text
    assert "Combined vs separate: the errors add up" in text
    assert "In vLLM, against the unquantized model's run (bfloat16 cache, perplexity " \
        "18.4000)" in text
    change = f"{19.16 / 18.40 - 1:+.2%}"
    assert (f"| both (quantized weights, FP8 cache) | fp8 | 19.1600 | {change} | "
            f"[{0.2 / 18.40:+.2%}, {0.8 / 18.40:+.2%}] | 90.00% | 0.1000 |") in text


def test_bench_table(ckpt, tmp_path):
    """A measured bench JSON, then the same without its "command" (older kvcalib)."""
    measured = ROOT / "docs" / "measured" / "card-smollm2" / "bench.json"
    data = json.loads(measured.read_text())
    first = data["caches"][0]
    tpot = first["rows"][0]["p50_tpot_ms"]  # under 100 ms: one decimal
    text = card(ckpt, "--bench", measured, "--print")
    served = first.get("served_as")
    label = first["kv_cache_dtype"] + (f" ({served})" if served not in (None, first[
        "kv_cache_dtype"]) else "")
    line = next(line for line in text.splitlines()
                if line.startswith(f"| {label} | "
                                   f"{first['capacity']['tokens']:,} | 1 | "))
    assert f"| {tpot['median']:.1f} [{tpot['min']:.1f}-{tpot['max']:.1f}] |" in line
    assert f"`{data['command']}`" in text
    del data["command"]
    older = tmp_path / "bench.json"
    older.write_text(json.dumps(data))
    assert "not recorded" in card(ckpt, "--bench", older, "--print")


def test_lm_eval_tables(ckpt, tmp_path):
    """`kvcalib lm-eval --json` as measured: each accuracy with its Wilson interval, each
    paired comparison, the recovery sentences (the card computes them again from the
    examples, and they must be the ones the run wrote); a malformed one is a usage error."""
    measured = ROOT / "docs" / "measured" / "card-smollm2" / "lm-eval.json"
    data = json.loads(measured.read_text())
    text = card(ckpt, "--lm-eval", measured, "--print")
    for row in data["table"]:
        assert (f"| {row['config']} | {row['task']} | {row['length']} | {row['n']} | "
                f"{100 * row['accuracy']:.1f}% [{100 * row['low']:.1f}%, "
                f"{100 * row['high']:.1f}%] |") in text
    for pair in data["comparisons"]:
        assert f"| {pair['b']} vs {pair['a']} | {pair['n']} | {pair['only_a']} | " in text
    assert all(f"- {line}" in text for line in data["verdict"])
    assert f"`{data['command']}`" in text
    broken = tmp_path / "broken.json"
    for bad in ({"configs": [{"name": "auto"}]}, {"options": {}}, {"samples": [1]},
                {"options": []}):
        broken.write_text(json.dumps({**data, **bad}))
        assert_error(run_kvcalib("card", ckpt, "--lm-eval", broken, "--print"), 2,
                     "not a `kvcalib lm-eval --json` result")


def test_generic_results(ckpt, tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"command": "kvcalib lm-eval ckpt --json rows.json",
                                "rows": [{"task": "gsm8k", "auto": 0.25, "fp8": 0.5}]}))
    harness = tmp_path / "harness.json"
    harness.write_text(json.dumps({"results": {"gsm8k": {
        "alias": "gsm8k", "exact_match,strict-match": 0.3,
        "exact_match_stderr,strict-match": 0.02}}}))
    assert "| gsm8k | 0.25 | 0.5 |" in card(ckpt, "--lm-eval", rows, "--print")
    text = card(ckpt, "--lm-eval", harness, "--print")
    assert "| gsm8k | exact_match | strict-match | 0.3 | 0.02 |" in text
    assert "not recorded" in text  # a JSON without "command"


def test_update_keeps_the_rest_and_is_idempotent(ckpt):
    readme = ckpt / "README.md"
    before, after = "\n# Mine\n\nKept as it is.  \n\n", "\n\n## Licence\n\nAlso kept.\n"
    readme.write_text("---\nlicense: apache-2.0\ntags:\n- mine\n---\n"
                      f"{before}{BEGIN}\nstale\n{END}{after}")
    card(ckpt, "--base-model", "other/base")
    first = readme.read_bytes()
    loaded = ModelCard.load(readme)
    assert loaded.data.license == "apache-2.0"  # the user's keys stay, ours are set
    assert loaded.data.tags == ["mine", *OURS]
    assert loaded.data.base_model == "other/base"
    assert loaded.text.startswith(before + BEGIN) and loaded.text.endswith(END + after)
    assert "stale" not in loaded.text
    card(ckpt, "--base-model", "other/base")
    assert readme.read_bytes() == first


def test_a_readme_without_markers_gets_the_part_appended(ckpt):
    readme = ckpt / "README.md"
    readme.write_text("# Notes\nno newline at the end")
    card(ckpt)
    text = ModelCard.load(readme).text
    assert text.startswith("# Notes\nno newline at the end\n\n" + BEGIN)
    first = readme.read_bytes()
    card(ckpt)
    assert readme.read_bytes() == first


def test_a_hard_linked_readme_is_replaced_not_written_through(ckpt, tmp_path):
    other = tmp_path / "input-README.md"  # e.g. the input model's, linked by --weights link
    other.write_text("# The input model\n")
    os.link(other, ckpt / "README.md")
    digest = hashlib.sha256(other.read_bytes()).hexdigest()
    card(ckpt)
    assert hashlib.sha256(other.read_bytes()).hexdigest() == digest
    assert (ckpt / "README.md").stat().st_ino != other.stat().st_ino
    assert BEGIN in (ckpt / "README.md").read_text()


def test_output_elsewhere_leaves_the_checkpoint(ckpt, tmp_path):
    card(ckpt, "--output", tmp_path / "card.md")
    assert ModelCard.load(tmp_path / "card.md").data.library_name == "vllm"
    assert not (ckpt / "README.md").exists()


@pytest.mark.parametrize("case, message", [
    ("no report", "has no kvcalib_report.json"),
    ("eval not JSON", "eval.json is not valid JSON"),
    ("eval a list", "is not a result: top level is not a JSON object"),
    ("eval not eval's", "--eval: not a `kvcalib eval --json` result"),
    ("one marker", "the README has 1 <!-- kvcalib:begin --> and 0"),
    ("front matter a list", "the README's front matter cannot be read"),
    ("output is the eval JSON", "eval.json is the input"),
])
def test_bad_input_is_refused(case, message, ckpt, tmp_path):
    args: list[object] = []
    readme = ckpt / "README.md"
    path = eval_json(tmp_path)
    if case == "no report":
        (ckpt / "kvcalib_report.json").unlink()
    elif case == "eval not JSON":
        path.write_text("{not json")
        args = ["--eval", path]
    elif case == "eval a list":
        path.write_text("[]")
        args = ["--eval", path]
    elif case == "eval not eval's":
        path.write_text(json.dumps({"metrics": {"calibrated": {"mean_kl": 1}}}))
        args = ["--eval", path]
    elif case == "one marker":
        readme.write_text(f"text\n{BEGIN}\n")
    elif case == "front matter a list":
        readme.write_text("---\n- a\n---\ntext\n")
    else:
        args = ["--eval", path, "--output", path]
    before = readme.read_bytes() if readme.exists() else None
    assert_error(run_kvcalib("card", ckpt, *args), 2, message)
    assert (readme.read_bytes() if readme.exists() else None) == before


def test_json_results_record_their_command(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    result = run_kvcalib("estimate", config, "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["command"] == shlex.join(
        ["kvcalib", "estimate", str(config), "--json", "-"])
