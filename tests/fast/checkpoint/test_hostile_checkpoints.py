"""Hostile and malformed checkpoints: every file a checkpoint holds is untrusted input.

Each case runs the real `kvcalib` command under a timeout and an address-space cap, and
must end in exit 1 (verify: a finding) or 2 (inspect, estimate, eval: bad input) with one
clear message: never a hang, never a traceback, never a pass when nothing was checked,
never a read outside the checkpoint folder. The safetensors library itself is the oracle
for which headers are valid.
"""

from __future__ import annotations

import json
import os
import resource
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import run_kvcalib
from tiny_files import complete_weights, valid_report

MEMORY_CAP = 2 * 2**30
TIMEOUT = 60
LAYERS, HEADS, KV_HEADS = 2, 8, 2
SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
          "strategy": "attn_head"}


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def kvcalib(*args: object) -> tuple[int, str, str]:
    """The real command, bounded in time (TimeoutExpired fails the test) and memory."""
    result = run_kvcalib(*args, timeout=TIMEOUT, preexec_fn=_capped)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    return result.returncode, result.stdout, result.stderr


def config(**changes) -> dict:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "hidden_size": 512, "torch_dtype": "bfloat16",
           "max_position_embeddings": 4096,
           "quantization_config": {"quant_method": "compressed-tensors", "format": "dense",
                                   "config_groups": {}, "kv_cache_scheme": SCHEME}}
    cfg.update(changes)
    return cfg


def scales() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"model.layers.{i}.self_attn.{k}_scale":
            rng.uniform(0.01, 0.05, (KV_HEADS, 1, 1)).astype(np.float32)
            for i in range(LAYERS) for k in "kv"}


def checkpoint(folder: Path, cfg: dict | None = None) -> Path:
    """config.json, stand-ins for the weights and the scale tensors: verify passes it."""
    folder.mkdir(parents=True)
    cfg = cfg or config()
    (folder / "config.json").write_text(json.dumps(cfg))
    # the files hold LAYERS layers, whatever the config claims
    weights = complete_weights({**cfg, "num_hidden_layers": LAYERS})
    save_file({**weights, **scales()}, folder / "model.safetensors")
    return folder


def raw_safetensors(path: Path, header: object, data: bytes = b"") -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def verify_fails(ckpt: Path, tmp_path: Path, expected: str) -> dict:
    report = tmp_path / "verify.json"
    code, stdout, stderr = kvcalib("verify", ckpt, "--static-only", "--json", report)
    assert code == 1, stdout + stderr
    result = json.loads(report.read_text())
    failed = [c["message"] for c in result["checks"] if c["status"] == "fail"]
    assert any(expected in m for m in failed), failed
    assert "Result: FAIL (exit code 1)" in stdout
    return result


def refused(command: str, target: Path, expected: str, *args: object) -> str:
    code, stdout, stderr = kvcalib(command, target, *args)
    assert code == 2, stdout + stderr
    line = one_error_line(stderr)
    assert expected in line, line
    return line


def test_the_base_checkpoint_passes(tmp_path):
    """The cases below start from this checkpoint: their failures are the edits'."""
    ckpt = checkpoint(tmp_path / "ckpt")
    code, stdout, _ = kvcalib("verify", ckpt, "--static-only")
    assert code == 0, stdout
    assert kvcalib("inspect", ckpt)[0] == 0
    assert kvcalib("estimate", ckpt)[0] == 0


# ----- denial of service: FIFOs and absurd counts ----- #


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "hf_quant_config.json"])
def test_a_fifo_never_hangs(name, tmp_path):
    cfg = config()
    if name == "hf_quant_config.json":
        del cfg["quantization_config"]  # then ModelOpt's legacy file is read
    ckpt = checkpoint(tmp_path / "ckpt", cfg)
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    verify_fails(ckpt, tmp_path, f"{name} is not a regular file")
    refused("inspect", ckpt, f"{name} is not a regular file")
    if name == "config.json":
        refused("estimate", ckpt, "config.json is not a regular file")


def test_a_billion_layers_is_a_finding_not_a_loop(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", config(num_hidden_layers=10**9))
    verify_fails(ckpt, tmp_path, "declares 1,000,000,000 layers")
    refused("inspect", ckpt, "declares 1,000,000,000 layers")
    refused("estimate", ckpt, "declares 1,000,000,000 layers")


def test_more_layers_than_the_weights_hold(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", config(num_hidden_layers=40))
    verify_fails(ckpt, tmp_path, "the weights hold no tensor of attention layers 2-39")


# ----- checkpoints that must not pass ----- #


@pytest.mark.parametrize("layers", [0, -5])
def test_no_layers_is_not_a_pass(layers, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", config(num_hidden_layers=layers))
    verify_fails(ckpt, tmp_path, f"num_hidden_layers is {layers}; it must be an integer")
    refused("estimate", ckpt, f"num_hidden_layers is {layers}")


def test_no_attention_layer_is_not_a_pass(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", config(layer_types=["mamba"] * LAYERS))
    verify_fails(ckpt, tmp_path, "declares no attention layers (2 layers: mamba)")


def _rewrite_offsets(path: Path, edit: Callable[[dict], None]) -> None:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    data = path.read_bytes()
    header = json.loads(data[8:8 + length])
    edit(header)
    raw_safetensors(path, header, data[8 + length:])


def _overlap(header: dict) -> None:
    entries = [v for k, v in header.items() if k != "__metadata__"]
    entries[1]["data_offsets"] = entries[0]["data_offsets"]


def _gap(header: dict) -> None:
    for entry in header.values():
        if isinstance(entry, dict) and "data_offsets" in entry and entry["data_offsets"][0] == 0:
            entry["data_offsets"] = [8, 8 + entry["data_offsets"][1]]


@pytest.mark.parametrize("edit", [_overlap, _gap], ids=["overlap", "gap"])
def test_invalid_offsets_fail_as_safetensors_refuses_them(edit, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    _rewrite_offsets(ckpt / "model.safetensors", edit)
    with pytest.raises(Exception, match=r"offset|incomplete"):  # the oracle refuses it too
        safe_open(ckpt / "model.safetensors", "np")
    verify_fails(ckpt, tmp_path, "model.safetensors:")
    refused("inspect", ckpt, "model.safetensors:")


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    elsewhere = checkpoint(tmp_path / "elsewhere")
    ckpt = checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    verify_fails(ckpt, tmp_path, "model.safetensors is a link to a file outside the checkpoint")


def test_a_link_to_a_system_file_leaks_none_of_its_bytes(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    ckpt = checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(secret)
    result = verify_fails(ckpt, tmp_path, "outside the checkpoint folder")
    (leaked,) = struct.unpack("<Q", secret.read_bytes()[:8])
    assert str(leaked) not in json.dumps(result)
    # Inside the folder, such a file is refused without echoing its bytes either.
    secret.rename(ckpt / "model.safetensors")
    result = verify_fails(ckpt, tmp_path, "model.safetensors: not a safetensors file")
    assert str(leaked) not in json.dumps(result) and "root:x" not in json.dumps(result)


def test_a_hugging_face_cache_snapshot_still_passes(tmp_path):
    """The Hub cache links snapshots/REV/FILE to ../../blobs/HASH: that must keep working."""
    repo = tmp_path / "hub" / "models--org--model"
    source = checkpoint(tmp_path / "source")
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, item in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        item.rename(blob)
        (snapshot / item.name).symlink_to(Path("../../blobs") / blob.name)
    code, stdout, _ = kvcalib("verify", snapshot, "--static-only")
    assert code == 0, stdout


@pytest.mark.parametrize("field, value", [("num_key_value_heads", -3),
                                          ("max_position_embeddings", -5),
                                          ("sliding_window", -100),
                                          ("num_attention_heads", 0),
                                          ("head_dim", 0),
                                          ("num_key_value_heads", "3")])
def test_estimate_refuses_impossible_geometry(field, value, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", config(**{field: value}))
    refused("estimate", ckpt, f"config.json: {field} is", "--budget", "1GiB")
    if field != "max_position_embeddings":  # not part of the KV cache's shape
        verify_fails(ckpt, tmp_path, f"config.json: {field} is")


# ----- malformed files: one Error line, the documented exit code ----- #


def _header_cases() -> dict[str, Callable[[Path], None]]:
    def write(header: object, data: bytes = b"") -> Callable[[Path], None]:
        return lambda ckpt: raw_safetensors(ckpt / "model.safetensors", header, data)

    one = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    return {
        "list": write([1, 2, 3]),
        "negative offset": write({"x": {**one, "data_offsets": [-4, 0]}}, b"\0" * 4),
        "odd bf16": write({"x": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 5]}},
                          b"\0" * 5),
        "negative shape": write({"x": {**one, "shape": [-1, -3]}}, b"\0" * 4),
        "unknown dtype": write({"x": {**one, "dtype": "F7"}}, b"\0" * 4),
        "deep nesting": write(b"[" * 200_000 + b"]" * 200_000),
        "not utf-8": write(b'{"x\xff": 1}'),
        "metadata not strings": write({"__metadata__": {"a": 1}, "x": one}, b"\0" * 4),
        "trailing bytes": write({"x": one}, b"\0" * 8),
        "empty": lambda ckpt: (ckpt / "model.safetensors").write_bytes(b"\x01\x02"),
    }


HEADER_CASES = _header_cases()


@pytest.mark.parametrize("case", HEADER_CASES)
def test_malformed_safetensors_header(case, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    HEADER_CASES[case](ckpt)
    with (pytest.raises(Exception),  # noqa: B017 (the oracle raises its own error type)
          safe_open(ckpt / "model.safetensors", "np") as f):
        [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118
    verify_fails(ckpt, tmp_path, "model.safetensors")
    refused("inspect", ckpt, "model.safetensors")


@pytest.mark.parametrize("case", ["not utf-8", "directory", "deep nesting", "not a map",
                                  "absolute path"])
def test_malformed_index(case, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    index = ckpt / "model.safetensors.index.json"
    weight_map = {name: "model.safetensors" for name in scales()}
    if case == "not utf-8":
        index.write_bytes(b'{"weight_map": {"\xff": 1}}')
    elif case == "directory":
        index.mkdir()
    elif case == "deep nesting":
        index.write_text("[" * 200_000 + "]" * 200_000)
    elif case == "not a map":
        index.write_text(json.dumps({"weight_map": list(weight_map)}))
    else:
        index.write_text(json.dumps({"weight_map": {**weight_map, "x": "/etc/passwd"}}))
    result = verify_fails(ckpt, tmp_path, "model.safetensors.index.json")
    assert "root:" not in json.dumps(result)
    refused("inspect", ckpt, "model.safetensors.index.json")


@pytest.mark.parametrize("case, expected", [
    ("scheme is a string", "kv_cache_scheme must be a JSON object"),
    ("quantization_config is a list", "quantization_config must be a JSON object"),
    ("config is a directory", "config.json is not a regular file"),
    ("config is a list", "config.json is not a model config"),
    ("config nests deeply", "config.json is not valid JSON: nested too deeply"),
    ("invalid hf_quant_config", "hf_quant_config.json is not valid JSON"),
    ("layer_types not a list", "layer_types must be a list"),
])
def test_malformed_config(case, expected, tmp_path):
    cfg = config()
    ckpt = checkpoint(tmp_path / "ckpt", cfg)
    if case == "scheme is a string":
        cfg["quantization_config"]["kv_cache_scheme"] = "fp8"
    elif case == "quantization_config is a list":
        cfg["quantization_config"] = ["fp8"]
    elif case == "layer_types not a list":
        cfg["layer_types"] = "full_attention"
    elif case == "invalid hf_quant_config":
        del cfg["quantization_config"]
        (ckpt / "hf_quant_config.json").write_text("{not json")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    if case == "config is a directory":
        (ckpt / "config.json").unlink()
        (ckpt / "config.json").mkdir()
    elif case == "config is a list":
        (ckpt / "config.json").write_text("[1, 2]")
    elif case == "config nests deeply":
        (ckpt / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    verify_fails(ckpt, tmp_path, expected)
    refused("inspect", ckpt, expected)


@pytest.mark.parametrize("report, expected", [
    ("{not json", "kvcalib_report.json is not valid JSON"),
    ("[]", "kvcalib_report.json is not a kvcalib calibration report: top level"),
    ('{"schema_version": 99}', "kvcalib_report.json has schema version 99"),
    ("VALID-WITHOUT-dataset", "kvcalib_report.json is not a kvcalib calibration report: "
                              "dataset: Field required"),
    ("VALID-WITH-rows_used=['a']", "kvcalib_report.json is not a kvcalib calibration report: "
                                   "dataset.rows_used.0"),
])
def test_malformed_report(report, expected, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    if report.startswith("VALID"):
        data = valid_report(LAYERS)
        if "WITHOUT" in report:
            del data["dataset"]
        else:
            data["dataset"]["rows_used"] = ["a"]
        report = json.dumps(data)
    (ckpt / "kvcalib_report.json").write_text(report)
    refused("inspect", ckpt, expected)  # eval: tests/evaluate/test_eval_cli.py


def test_a_valid_report_is_read(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    (ckpt / "kvcalib_report.json").write_text(json.dumps(valid_report(LAYERS)))
    code, stdout, stderr = kvcalib("inspect", ckpt, "--json", "-")
    assert code == 0, stderr
    assert json.loads(stdout)["calibration"]["dataset"]["rows_used"] == [1, 2]
