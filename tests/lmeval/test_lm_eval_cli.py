"""`kvcalib lm-eval` as users run it, on the calibrated SmolLM2: one engine start (FP8 at
scale 1.0, from a scale-free view of the checkpoint), and the view itself."""

from __future__ import annotations

import hashlib
import json

import pytest
from safetensors import safe_open

from conftest import assert_error, run_kvcalib
from kvcalib.checkpoint.write import write_without_kv_scales


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _tensors(folder) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            names = list(f.keys())  # a safe_open handle is not iterable
            out.update({name: f.get_tensor(name).float().numpy().tobytes() for name in names})
    return out


def test_scale_free_view_drops_only_the_kv_scales(smol_attn_head, tmp_path):
    before = _digests(smol_attn_head)
    view = tmp_path / "view"
    view.mkdir()
    dropped = write_without_kv_scales(smol_attn_head, view)
    assert len(dropped) == 60 and all(n.endswith(("k_scale", "v_scale")) for n in dropped)
    original, kept = _tensors(smol_attn_head), _tensors(view)
    assert set(kept) == set(original) - set(dropped)
    assert all(kept[name] == original[name] for name in kept)  # the same weights
    config = json.loads((view / "config.json").read_text())
    assert "quantization_config" not in config  # it declared nothing but the KV cache
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(kept)
    assert (view / "tokenizer.json").is_symlink()
    assert _digests(smol_attn_head) == before  # the input is untouched


@pytest.mark.engine
def test_lm_eval_scale_one_on_calibrated_smollm2(smol_attn_head, fp8_kv_supported, tmp_path):
    before = _digests(smol_attn_head)
    result = run_kvcalib("lm-eval", smol_attn_head, "--tasks", "niah_single_1",
                         "--lengths", 512, "--limit", 4, "--configs", "fp8-scale-one",
                         "--json", tmp_path / "r.json", "--plot", tmp_path / "r.png",
                         timeout=900)
    assert _digests(smol_attn_head) == before
    assert "Traceback" not in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    (config,) = report["configs"]
    if not fp8_kv_supported:
        assert result.returncode == 2, result.stderr
        assert not config["ran"] and "cannot store an FP8 KV cache" in config["reason"]
        return
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert config["ran"], config
    samples = report["samples"]
    assert len(samples) == 4 and {s["length"] for s in samples} == {512}
    # Each example's score recomputed from its answer: RULER's string match, every needle.
    for s in samples:
        assert s["score"] == float(all(t.lower() in s["response"].lower() for t in s["target"]))
        assert s["depth"] in ("0-20%", "20-40%", "40-60%", "60-80%", "80-100%")
    (row,) = report["table"]
    assert row["n"] == 4 and row["accuracy"] == sum(s["score"] for s in samples) / 4
    assert row["low"] is None  # 4 < 12 examples: no interval
    assert config["accuracy"] == row["accuracy"] and config["recovery"] is None
    assert "niah_single_1" in result.stdout and (tmp_path / "r.png").stat().st_size > 0


def test_usage_errors(smol_attn_head, tmp_path):
    assert_error(run_kvcalib("lm-eval", smol_attn_head, "--configs", "fp16"), 2,
                 "unknown --configs fp16")
    assert_error(run_kvcalib("lm-eval", smol_attn_head, "--lengths", "2048",
                             "--max-model-len", "1024"), 2, "below the longest --lengths")
    assert_error(run_kvcalib("lm-eval", tmp_path), 2, "not a model folder")
