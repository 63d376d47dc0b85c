"""Property-based fuzzing of everything that reads a checkpoint without an engine.

Hypothesis builds checkpoint folders from hostile parts: config.json (and its
quantization_config, ModelOpt's hf_quant_config.json), safetensors headers (lengths,
offsets, dtypes, shapes, non-ASCII names, nesting), index files, the calibration report,
and files that are FIFOs, folders or links out of the checkpoint. For every input,
`verify --static-only`, `inspect` and `estimate` (their library calls, as the CLI makes
them) must end in a result or in one KvcalibError of one line: never another exception,
never a read of the secret file beside the checkpoint, within a time and memory bound.

`scripts/fuzz_static.py --examples N` runs the same property longer.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcalib import verify
from kvcalib.checkpoint import inspect as inspection
from kvcalib.dtypes import DTYPES
from kvcalib.errors import KvcalibError
from kvcalib.kvcache import capacity
from tiny_files import complete_weights

EXAMPLES = int(os.environ.get("KVCALIB_FUZZ_EXAMPLES", "60"))
SECONDS_PER_CALL = 10.0
PEAK_BYTES = 256 * 2**20

# ----- what a checkpoint can hold ----- #

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
hostile_int = st.sampled_from([0, -1, -5, 10**9, 2**63, 2**64 + 1, True, 1.5, "8"])


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy = anything) -> st.SearchStrategy:
    """Valid most of the time, so that the fuzzer gets past the first check."""
    return st.one_of(valid, valid, valid, hostile)


FP8_MAX = 448.0
SCALE_NAMES = {"compressed-tensors": "model.layers.{layer}.self_attn.{kind}_scale",
               "fp8": "model.layers.{layer}.self_attn.{kind}_scale",
               "modelopt": "model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale",
               "quark": "model.layers.{layer}.self_attn.{kind}_proj.output_scale"}
QUARK_KV = {"output_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}}
NUMPY = {"F32": "<f4", "F16": "<f2"}


@st.composite
def valid_checkpoints(draw: st.DrawFn) -> dict:
    """A consistent checkpoint that verify must pass: config, scheme and scale tensors."""
    layers, heads = draw(st.integers(1, 4)), draw(st.sampled_from([4, 8]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    layout = draw(st.sampled_from(sorted(SCALE_NAMES)))
    strategy = draw(st.sampled_from(["tensor", "attn_head"])) if (
        layout == "compressed-tensors") else "tensor"
    with_q = layout == "compressed-tensors" and draw(st.booleans())
    quant = {"fp8": {"quant_method": "fp8"},
             "modelopt": {"quant_method": "modelopt", "quant_algo": "FP8",
                          "kv_cache_scheme": {"type": "float", "num_bits": 8}},
             "quark": {"quant_method": "quark", "kv_cache_post_rope": True,
                       "export": {"kv_cache_group": ["*k_proj", "*v_proj"]},
                       "layer_quant_config": {"*k_proj": QUARK_KV, "*v_proj": QUARK_KV}},
             "compressed-tensors": {
                 "quant_method": "compressed-tensors", "format": "dense",
                 "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                     "dynamic": False, "strategy": strategy},
                 "config_groups": {"attention": {"targets": ["LlamaAttention"],
                                                 "input_activations": {"num_bits": 8}}}
                 if with_q else {}}}[layout]
    config = {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "hidden_size": 64 * heads,
              "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
              "quantization_config": quant}
    dtype = draw(st.sampled_from(sorted(NUMPY)))
    values = st.floats(1e-3, 0.1)
    tensors = {}
    for layer in range(layers):
        for kind in ("k", "v", "q") if with_q else ("k", "v"):
            count = 1 if strategy == "tensor" else heads if kind == "q" else kv_heads
            shape = [count, 1, 1] if strategy == "attn_head" else [1]
            data = np.array(draw(st.lists(values, min_size=count, max_size=count)),
                            dtype=NUMPY[dtype])
            name = SCALE_NAMES[layout].format(layer=layer, kind=kind)
            tensors[name] = {"dtype": dtype, "shape": shape, "data": data.tobytes()}
    for name, stand_in in complete_weights(config).items():
        tensors[name] = {"dtype": "F16", "shape": [1], "data": stand_in.tobytes()}
    shards = ["model.safetensors"] if draw(st.booleans()) else ["a.safetensors", "b.safetensors"]
    placement = {name: shards[i % len(shards)] for i, name in enumerate(sorted(tensors))}
    return {"config": config, "tensors": tensors, "placement": placement,
            "index": len(shards) > 1 or draw(st.booleans()), "extra": {},
            "kinds": {}, "raw": {}}


scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
hostile_number = st.sampled_from([0, -1, -5, 10**9, 2**63, 2**64 + 1, True, 1.5, "8", None,
                                  float("nan")])
REQUIRED_FIELDS = {"num_hidden_layers", "num_attention_heads", "hidden_size",
                   "max_position_embeddings"}
CONFIG_FIELDS = ["model_type", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "hidden_size", "head_dim", "max_position_embeddings",
                 "sliding_window", "layer_types", "torch_dtype", "text_config", "multi_query",
                 "quantization_config"]
FILES = ["config.json", "model.safetensors", "a.safetensors", "b.safetensors",
         "model.safetensors.index.json", "kvcalib_report.json", "hf_quant_config.json"]


def _config_field(draw: st.DrawFn, ckpt: dict) -> None:
    """Any value, but not null where the shape needs the field: a missing field is completed
    from transformers' class defaults, which imports torch (outside this fast test)."""
    field = draw(st.sampled_from(CONFIG_FIELDS))
    ckpt["config"][field] = draw(st.one_of(hostile_number, anything).filter(
        lambda value: value is not None or field not in REQUIRED_FIELDS))


def _scheme_field(draw: st.DrawFn, ckpt: dict) -> None:
    quant = ckpt["config"].get("quantization_config")
    if not isinstance(quant, dict):
        return
    target = quant.get("kv_cache_scheme", quant)
    if not isinstance(target, dict):
        return
    key = draw(st.sampled_from([*sorted(target), "kv_cache_group", "config_groups"]))
    target[key] = draw(st.one_of(hostile_number, anything))


def _scale_value(draw: st.DrawFn, ckpt: dict) -> None:
    name = draw(st.sampled_from(sorted(ckpt["tensors"])))
    tensor = ckpt["tensors"][name]
    if tensor["dtype"] in NUMPY:
        bad = draw(st.sampled_from([float("nan"), float("inf"), 0.0, -0.02, 1e-39, 3e38, 1.0]))
        data = np.frombuffer(tensor["data"], NUMPY[tensor["dtype"]]).copy()
        with np.errstate(over="ignore"):  # 3e38 is inf in float16: hostile all the same
            data[draw(st.integers(0, data.size - 1))] = bad
        tensor["data"] = data.tobytes()


def _scale_header(draw: st.DrawFn, ckpt: dict) -> None:
    name = draw(st.sampled_from(sorted(ckpt["tensors"])))
    tensor = ckpt["tensors"][name]
    key = draw(st.sampled_from(["dtype", "shape", "name", "delete", "duplicate"]))
    if key == "dtype":
        tensor["dtype"] = draw(st.sampled_from([*DTYPES, "F7", ""]))
    elif key == "shape":
        tensor["shape"] = draw(st.lists(st.integers(-3, 2**40), max_size=3) | anything)
    elif key == "name":  # non-ASCII and look-alike names
        ckpt["tensors"][draw(st.text(min_size=1, max_size=12))] = ckpt["tensors"].pop(name)
    elif key == "delete":
        del ckpt["tensors"][name]
    else:
        ckpt["tensors"][name.replace(".self_attn.", ".self_attn.k_proj.", 1)] = dict(tensor)


def _file_kind(draw: st.DrawFn, ckpt: dict) -> None:
    ckpt["kinds"][draw(st.sampled_from(FILES))] = draw(
        st.sampled_from(["fifo", "folder", "link to secret", "missing"]))


def _raw_bytes(draw: st.DrawFn, ckpt: dict) -> None:
    """Corrupt one file's bytes after it is written: header length, truncation, garbage."""
    ckpt["raw"][draw(st.sampled_from(FILES))] = draw(st.sampled_from(
        ["length", "truncate", "append", "header", "nesting", "not utf-8"]))


def _index_entry(draw: st.DrawFn, ckpt: dict) -> None:
    ckpt["index"] = True
    name = draw(st.sampled_from(sorted(ckpt["placement"]) or ["x"]))
    ckpt["placement"][name] = draw(st.one_of(
        st.sampled_from(["../secret/secret.bin", "/etc/hostname", "gone.safetensors",
                         "sub/../model.safetensors", ".", ""]), anything))


def _extra_file(draw: st.DrawFn, ckpt: dict) -> None:
    name = draw(st.sampled_from(["kvcalib_report.json", "hf_quant_config.json"]))
    ckpt["extra"][name] = draw(st.one_of(anything.map(json.dumps),
                                         st.sampled_from(["{", "[" * 5000, "\xff", ""])))


MUTATIONS = [_config_field, _scheme_field, _scale_value, _scale_header, _file_kind, _raw_bytes,
             _index_entry, _extra_file]


@st.composite
def checkpoints(draw: st.DrawFn) -> dict:
    """A valid checkpoint with up to three hostile edits; `mutations` counts them."""
    ckpt = draw(valid_checkpoints())
    ckpt["mutations"] = draw(st.integers(0, 3))
    for _ in range(ckpt["mutations"]):
        draw(st.sampled_from(MUTATIONS))(draw, ckpt)
    return ckpt


def _safetensors(tensors: dict) -> bytes:
    header, data, offset = {}, b"", 0
    for name, tensor in tensors.items():
        header[name] = {"dtype": tensor["dtype"], "shape": tensor["shape"],
                        "data_offsets": [offset, offset + len(tensor["data"])]}
        offset += len(tensor["data"])
        data += tensor["data"]
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def _corrupt(raw: bytes, how: str) -> bytes:
    if how == "length":
        return struct.pack("<Q", 2**63 + 7) + raw[8:]
    if how == "truncate":
        return raw[: len(raw) // 2]
    if how == "append":
        return raw + b"\0" * 3
    if how == "header":
        return struct.pack("<Q", 2) + b"[]" + raw[8:]
    if how == "nesting":
        return b"[" * 3000 + b"]" * 3000
    return b"\xff\xfe" + raw


def materialize(ckpt: dict, root: Path) -> tuple[Path, Path]:
    """Write the described checkpoint into root/ckpt, and a secret file beside it."""
    folder, secret = root / "ckpt", root / "secret" / "secret.bin"
    folder.mkdir()
    secret.parent.mkdir()
    secret.write_bytes(_safetensors({}))  # a valid safetensors file: reading it would pass
    files = {"config.json": json.dumps(ckpt["config"]).encode()}
    if not ckpt["index"]:
        files["model.safetensors"] = _safetensors(ckpt["tensors"])
    else:
        files["model.safetensors.index.json"] = json.dumps(
            {"weight_map": ckpt["placement"]}).encode()
        for shard in {where for where in ckpt["placement"].values() if where in FILES}:
            files[shard] = _safetensors({name: tensor for name, tensor in ckpt["tensors"].items()
                                         if ckpt["placement"].get(name) == shard})
    files.update({name: text.encode("utf-8", "surrogateescape")
                  for name, text in ckpt["extra"].items()})
    for name, how in ckpt["raw"].items():
        if name in files:
            files[name] = _corrupt(files[name], how)
    for name, content in files.items():
        kind = ckpt["kinds"].get(name, "regular")
        path = folder / name
        if kind == "regular":
            path.write_bytes(content)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()
        elif kind == "link to secret":
            path.symlink_to(secret)
    return folder, secret


# ----- the property ----- #

_opened: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _bounded(name: str, call) -> int:
    """One command: a result it can render, or one KvcalibError of one line, in bounds.
    Returns the exit code the CLI would give."""
    tracemalloc.reset_peak()
    started = time.monotonic()
    try:
        result = call()
    except KvcalibError as exc:
        assert str(exc) and "\n" not in str(exc), repr(exc)
        code = exc.exit_code
    else:
        code = result.exit_code if name == "verify" else 0
        assert result.summary()
        json.dumps(result.to_dict())
    assert time.monotonic() - started < SECONDS_PER_CALL
    assert tracemalloc.get_traced_memory()[1] < PEAK_BYTES
    event(f"{name}: exit {code}")
    return code


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(checkpoints())
def test_static_readers_never_crash_hang_or_leak(ckpt):
    with tempfile.TemporaryDirectory(prefix="kvcalib-fuzz-") as tmp:
        folder, secret = materialize(ckpt, Path(tmp))
        _opened.clear()
        tracemalloc.start()
        try:
            codes = [_bounded("verify", lambda: verify.verify(folder, static_only=True)),
                     _bounded("inspect", lambda: inspection.inspect(folder)),
                     _bounded("estimate", lambda: capacity.estimate(str(folder)))]
        finally:
            tracemalloc.stop()
        if ckpt["mutations"] == 0:  # the unedited checkpoint is valid: all three succeed
            assert codes == [0, 0, 0], codes
        read = {os.path.realpath(path) for path in _opened}
        assert str(secret) not in read and "/etc/hostname" not in read, read
