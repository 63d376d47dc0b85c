"""`kvcalib convert --strategy tensor`: one attn_head calibration gives the portable release
too. Its per-tensor scales must be bit for bit the ones a `--strategy tensor` run on the
same samples stores (read back with the tests' own safetensors reader), and pass verify.
Not in the fast tier: the compressed-tensors config it writes is built with
compressed-tensors' types, which import torch."""

from __future__ import annotations

import json
import re

import numpy as np

import peers
from conftest import run_kvcalib, verify_static

SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def scales_of(folder) -> dict[tuple[int, str], tuple[str, list[int], bytes]]:
    found = {}
    for path in folder.glob("*.safetensors"):
        for name, tensor in peers.raw_tensors(path).items():
            match = SCALE.match(name)
            if match:
                found[int(match[1]), match[2]] = tensor
    return found


def test_per_head_scales_become_a_tensor_runs_bit_for_bit(smol_attn_head, smol_tensor,
                                                            tmp_path):
    out = tmp_path / "portable"
    result = run_kvcalib("convert", smol_attn_head, "--strategy", "tensor", "--output", out,
                         "--json", "-")
    assert result.returncode == 0, result.stderr
    conversion = json.loads(result.stdout)
    assert (conversion["source_layout"], conversion["target_layout"],
            conversion["strategy"]) == ("compressed-tensors", "compressed-tensors", "tensor")
    assert any("what a per-tensor calibration on the same samples stores" in note
               for note in conversion["notes"])

    converted, calibrated, per_head = (scales_of(f) for f in (out, smol_tensor, smol_attn_head))
    assert converted.keys() == calibrated.keys() == per_head.keys() and converted
    for key, (dtype, shape, raw) in calibrated.items():
        assert converted[key] == (dtype, shape, raw), key  # dtype, shape and bytes
        heads = peers.as_float(per_head[key][0], per_head[key][2])
        assert float(peers.as_float(dtype, raw)[0]) == float(np.max(heads)), key

    scheme = json.loads((out / "config.json").read_text())["quantization_config"][
        "kv_cache_scheme"]
    assert scheme["strategy"] == "tensor"
    assert verify_static(out, tmp_path)[0] == 0
