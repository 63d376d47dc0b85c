"""Real vLLM engines on what Quark 0.13 and ModelOpt 0.47 really export, and on `kvcalib
convert`'s output: what static verify says about loading, the engine confirms.

The KV-only exports kept SmolLM2's weights bit for bit, so tests/peers.py rebuilds them
exactly from the fixtures and the demo model (checked against every tensor's sha256).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import peers
from conftest import failures, run_kvcalib, run_verify, verify_static

REFUSED = {"quark-kv": "kv_cache_group parameter setting, but no kv_cache quantization "
                       "settings were found",
           "modelopt-kv": "Missing 'quant_algo' in quantization config"}


@pytest.fixture(scope="module")
def exports(demo_model, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("peer-exports")
    return {name: peers.materialize(name, folder / name, weights_from=demo_model)
            for name in ("quark-kv", "quark-kv-post-rope", "modelopt-kv")}


@pytest.fixture(scope="module")
def cache_dtype(fp8_kv_supported) -> str:
    """FP8 where vLLM stores it on this machine; else bf16, which loads the scales too."""
    return "fp8" if fp8_kv_supported else "bfloat16"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_exports_vllm_refuses_fail_statically_and_in_the_engine(name, exports, cache_dtype,
                                                                tmp_path):
    code, report, _ = verify_static(exports[name], tmp_path)
    assert code == 1 and REFUSED[name] in failures(report)[0]
    result = run_verify(exports[name], tmp_path, "--kv-cache-dtype", cache_dtype)
    assert result["returncode"] == 1, result["stdout"]
    run = result["report"]["engine"]["runs"][cache_dtype]
    assert not run["started"] and REFUSED[name] in run["error"]


def _weights_as_exported(out: Path, name: str) -> None:
    """Every tensor but the KV scales is byte for byte the one the tool exported."""
    scales = set(peers.scales(name))
    written = {}
    for path in out.glob("*.safetensors"):
        written.update(peers.raw_tensors(path))
    for tensor, _, _, sha in peers.manifest(name)["tensors"]:
        if tensor not in scales:
            assert hashlib.sha256(written[tensor][2]).hexdigest() == sha, tensor


@pytest.mark.parametrize("source, to", [("quark-kv-post-rope", "compressed-tensors"),
                                        ("modelopt-kv", "quark")])
def test_conversions_of_real_exports_load_and_read_back(source, to, exports, cache_dtype,
                                                        tmp_path):
    out = tmp_path / "converted"
    result = run_kvcalib("convert", exports[source], "--to", to, "--output", out)
    assert result.returncode == 0, result.stderr
    _weights_as_exported(out, source)
    _loads_and_reads_back(out, to, cache_dtype, tmp_path)


def test_kvcalib_per_head_scales_convert_to_modelopt(smol_attn_head, cache_dtype, tmp_path):
    """compressed-tensors (kvcalib run, per head) to ModelOpt, which vLLM loads only with a
    quant_algo: convert writes FP8 with every module excluded."""
    out = tmp_path / "converted"
    result = run_kvcalib("convert", smol_attn_head, "--to", "modelopt", "--output", out,
                         "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"][
        "quant_algo"] == "FP8"
    _loads_and_reads_back(out, "modelopt", cache_dtype, tmp_path)


def _loads_and_reads_back(ckpt: Path, layout: str, cache_dtype: str, tmp_path: Path) -> None:
    """vLLM starts on the checkpoint and reads back all 60 scales; where this CPU cannot
    store an FP8 cache, vLLM loads ModelOpt and Quark scales nowhere, so the read-back is
    'not proven' (exit 2), never a pass."""
    result = run_verify(ckpt, tmp_path, "--kv-cache-dtype", cache_dtype)
    report = result["report"]
    assert report["scheme"]["layout"] == layout
    static = {(c["layer"], c["tensor"]): c["value"] for c in report["checks"]
              if c["group"] == "scales"}
    assert len(static) == 60
    assert [c["status"] for c in report["checks"] if c["group"] == "engine"] == ["pass"]
    readback = [c for c in report["checks"] if c["group"] == "readback"]
    if cache_dtype == "fp8" or layout == "compressed-tensors":
        assert result["returncode"] == 0, result["stdout"]
        assert len(readback) == 60 and all(c["status"] == "pass" for c in readback)
    else:
        assert result["returncode"] == 2, result["stdout"]
        assert [c["status"] for c in readback] == ["error"]
        assert readback[0]["message"].startswith(f"not proven: vLLM loads {layout} KV scales "
                                                 "only into an FP8 cache")


def test_modelopt_to_compressed_tensors(tmp_path):
    """The one direction the engine tests above leave out, statically: ModelOpt's F32
    scales become bf16 ones rounded up (never below what ModelOpt measured), shape (1,),
    under a kv_cache_scheme compressed-tensors itself parses."""
    from compressed_tensors.quantization import QuantizationConfig

    src = peers.materialize("modelopt-kv", tmp_path / "src")
    out = tmp_path / "out"
    result = run_kvcalib("convert", src, "--to", "compressed-tensors", "--output", out)
    assert result.returncode == 0, result.stderr
    written = peers.raw_tensors(out / "kv_scales.safetensors")
    for name, value in peers.scales("modelopt-kv").items():
        dtype, shape, raw = written[name.replace(".k_proj.k_scale", ".k_scale").replace(
            ".v_proj.v_scale", ".v_scale")]
        got = float(peers.as_float(dtype, raw)[0])
        assert (dtype, shape) == ("BF16", [1]) and value <= got < value * (1 + 2**-7)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert (parsed.kv_cache_scheme.num_bits, parsed.kv_cache_scheme.strategy) == (8, "tensor")
    assert verify_static(out, tmp_path)[0] == 0
