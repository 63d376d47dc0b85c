"""`kvcalib card` on SmolLM2 calibrated through the CLI: huggingface_hub's ModelCard.load
reads the card back, and what it says matches kvcalib_report.json and the scale tensors,
read here independently."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard
from safetensors.torch import load_file

from conftest import SCALES, run_kvcalib, tree_digest


def test_card_of_calibrated_smollm2(smol_attn_head, tmp_path):
    before = tree_digest(smol_attn_head)
    out = tmp_path / "README.md"
    result = run_kvcalib("card", smol_attn_head, "--base-model",
                         "HuggingFaceTB/SmolLM2-135M-Instruct", "--output", out)
    assert result.returncode == 0, result.stderr
    assert tree_digest(smol_attn_head) == before  # --output: the checkpoint is left as it was

    card = ModelCard.load(out)
    meta = card.data.to_dict()
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "vllm"
    assert "kvcalib" in meta["tags"]

    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    dataset, samples = report["dataset"], report["samples"]
    assert samples["used"] == 6 and samples["max_seq_len"] == 128  # as the fixture ran it
    assert f"`{dataset['token_ids_sha256']}`" in card.text
    assert f"{samples['used']} × ≤ {samples['max_seq_len']} tokens" in card.text
    assert f"| observer | {report['scheme']['observer']} |" in card.text
    assert "strategy attn_head" in card.text
    for package, version in report["versions"].items():
        assert f"{package} {version}" in card.text
    scales = load_file(smol_attn_head / SCALES)  # the stored scales, bf16 values as floats
    k = [x for name, t in scales.items() if name.endswith("k_scale")
         for x in t.float().flatten().tolist()]
    assert f"k_scale {min(k):.4g}..{max(k):.4g}" in card.text
    assert "vllm serve smol-attn-head --kv-cache-dtype fp8\n" in card.text
