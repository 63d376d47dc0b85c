"""Tiny Llama checkpoints written byte by byte, without torch or kvcalib: inputs for the
tests of what writing and verifying do to files (collisions, links, missing tensors). The
write properties' check (all_or_nothing) reads the output with kvcalib's static verify.

The parameter names are written out here from the Llama architecture (embedding, per
layer four attention projections, three MLP projections and two norms, final norm; tied
embeddings, so no lm_head), independently of the names kvcalib derives.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from hypothesis import event

import peers

LAYERS = 2
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 1, 32, 128
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "vocab_size": VOCAB, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
KV_SCHEME = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
             "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                 "dynamic": False, "symmetric": True}}


def weight_shapes() -> dict[str, list[int]]:
    """Every parameter of the tiny Llama and its shape."""
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": [HEADS * HEAD_DIM, HIDDEN],
            p + "self_attn.k_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
            p + "self_attn.v_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
            p + "self_attn.o_proj.weight": [HIDDEN, HEADS * HEAD_DIM],
            p + "mlp.gate_proj.weight": [INTER, HIDDEN],
            p + "mlp.up_proj.weight": [INTER, HIDDEN],
            p + "mlp.down_proj.weight": [HIDDEN, INTER],
            p + "input_layernorm.weight": [HIDDEN],
            p + "post_attention_layernorm.weight": [HIDDEN]})
    return shapes


def scale_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(LAYERS) for kind in "kv"]


def bf16(values: np.ndarray) -> bytes:
    """float values as bfloat16 bytes (truncated: any bf16 will do for weights)."""
    return (np.asarray(values, "<f4").view("<u4") >> 16).astype("<u2").tobytes()


def write_file(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    peers._write(path, [(name, dtype, shape, raw) for name, (dtype, shape, raw)
                        in sorted(tensors.items())])


def build(folder: Path, files: dict[str, list[str]], *, index: bool = False,
          scheme: bool = True, seed: int = 0) -> Path:
    """A tiny Llama in `folder`: `files` maps each safetensors file name to the tensor
    names it holds (weights of weight_shapes, scales of scale_names, 0.05 each). With
    `index`, a model.safetensors.index.json names them."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = weight_shapes()
    config = {**CONFIG, **({"quantization_config": KV_SCHEME} if scheme else {})}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"tiny": true}')
    for name, tensors in files.items():
        content = {}
        for tensor in tensors:
            if tensor in shapes:
                content[tensor] = ("BF16", shapes[tensor],
                                   bf16(rng.standard_normal(int(np.prod(shapes[tensor])))))
            else:
                content[tensor] = ("BF16", [1], bf16(np.array([0.05])))
        write_file(folder / name, content)
    if index:
        weight_map = {t: name for name, tensors in files.items() for t in tensors}
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": weight_map}))
    return folder


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (links followed), by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def indexed_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor the index of `folder` names, read from the file the index names
    (a KeyError when it is not there)."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    files = {name: peers.raw_tensors(folder / name) for name in set(weight_map.values())}
    return {tensor: files[name][tensor] for tensor, name in weight_map.items()}


def complete_weights(config: dict) -> dict[str, np.ndarray]:
    """One-value stand-ins for every weight `config`'s architecture needs, for tests of
    other things than that check (verify now fails a checkpoint without its weights).
    The names are the ones kvcalib.checkpoint.expected derives (the model class where
    transformers imports, else one weight per declared layer): this builds inputs, it
    checks nothing. At most 16 layers."""
    from kvcalib.checkpoint.expected import expected

    # at most 16 layers: hostile configs claim a billion, which the files never hold
    layers = config.get("num_hidden_layers")
    layers = min(layers, 16) if isinstance(layers, int) and not isinstance(layers, bool) else 0
    names = set(expected({**config, "num_hidden_layers": layers}).parameters) or {
        "model.embed_tokens.weight"} | {f"model.layers.{i}.mlp.down_proj.weight"
                                        for i in range(layers)}
    return {name: np.zeros(1, dtype=np.float16) for name in sorted(names)}


def kv_checkpoint(folder: Path, strategy: str = "tensor", head_dim: int = 64,
                  **extra: object) -> Path:
    """A two-layer Llama-shaped checkpoint (8 query and 2 KV heads of `head_dim`) with
    scales of 0.02 per layer or per KV head; `extra` goes into config.json."""
    from safetensors.numpy import save_file

    folder.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 8 * head_dim, "torch_dtype": "bfloat16",
              "quantization_config": {**KV_SCHEME, "kv_cache_scheme": {
                  **KV_SCHEME["kv_cache_scheme"], "strategy": strategy}}, **extra}
    (folder / "config.json").write_text(json.dumps(config))
    shape = (2, 1, 1) if strategy == "attn_head" else (1,)
    scales = {f"model.layers.{i}.self_attn.{k}_scale": np.full(shape, 0.02, np.float32)
              for i in (0, 1) for k in "kv"}
    save_file({**complete_weights(config), **scales}, folder / "model.safetensors")
    return folder


def input_folder(root: Path, cached: bool) -> Path:
    """Where a test's input goes: a plain folder, or a snapshot of the Hugging Face cache
    (models--ORG--NAME/snapshots/REV), whose files as_cache_links turns into links."""
    return root / ("models--kvcalib--tiny/snapshots/0123abcd" if cached else "src")


def as_cache_links(folder: Path) -> None:
    """Lay a snapshot `folder` out as the Hugging Face cache does: every weight file a
    symbolic link to a blob in the repository's blobs folder (../../blobs)."""
    blobs = folder.parent.parent / "blobs"
    blobs.mkdir(exist_ok=True)
    for path in folder.glob("*.safetensors"):
        path.rename(blobs / path.name)
        path.symlink_to(Path("../../blobs") / path.name)


def input_digests(folder: Path) -> dict[str, str]:
    """digests of `folder` (links followed) and of the cache's blobs its links lead to."""
    blobs = folder.parent.parent / "blobs"
    return {**digests(folder), **{f"blobs/{name}": digest for name, digest in
                                  (digests(blobs) if blobs.is_dir() else {}).items()}}


# The outputs the write properties draw (tests/fast/checkpoint/test_fuzz_writes.py for
# convert, tests/calibrate/test_fuzz_run.py for run).
OUTPUTS = ["fresh", "inside the input", "the input", "existing", "existing --overwrite",
           "holds a hard link --overwrite", "under a file", "in /proc"]


def prepare_output(kind: str, root: Path, src: Path) -> tuple[Path, bool]:
    """The output path for `kind` (one of OUTPUTS), made as it says; and whether
    --overwrite is given."""
    if kind == "inside the input":
        return src / "out", False
    if kind == "the input":
        return src, True
    if kind == "under a file":
        (root / "file").write_text("keep")
        return root / "file" / "out", False
    if kind == "in /proc":
        return Path("/proc/kvcalib-fuzz-out"), False
    out = root / "out"
    if kind.startswith(("existing", "holds")):
        out.mkdir()
        (out / "old.txt").write_text("old")
        if kind.startswith("holds"):  # a hard link to the input's files
            for first in sorted(src.glob("*.safetensors"))[:1]:
                os.link(first, out / first.name)
    return out, kind.endswith("--overwrite")


def snapshot(folder: Path) -> dict[str, str] | None:
    return digests(folder) if folder.is_dir() else None


def assert_nothing_left(out: Path, before_output: dict[str, str] | None) -> None:
    """After a refusal: an existing output is as it was, nothing new is there, and no
    temporary is left beside it."""
    assert snapshot(out) == before_output
    if out.parent.is_dir():
        left = [p.name for p in out.parent.iterdir() if p.name.startswith(".")]
        assert left == [], left


def all_or_nothing(src: Path, out: Path, write: Callable[[], object]) -> bool:
    """Run `write` (a command writing `out` from `src`) and check the write properties'
    property: every input file keeps its sha256; after a kvcalib error nothing is left
    (assert_nothing_left); after success static verify passes and every weight is where
    the index says (assert_weights_where_indexed). Returns whether it wrote."""
    from kvcalib.checkpoint.read import open_checkpoint
    from kvcalib.checks import FAIL
    from kvcalib.errors import KvcalibError

    before_input, before_output = input_digests(src), snapshot(out)
    try:
        write()
    except KvcalibError as exc:
        event(f"refused: {type(exc).__name__}")
        assert input_digests(src) == before_input
        assert_nothing_left(out, before_output)
        return False
    assert input_digests(src) == before_input
    _, checks = open_checkpoint(out)
    assert [c.message for c in checks if c.status == FAIL] == []
    assert_weights_where_indexed(out, src)
    return True


def assert_weights_where_indexed(out: Path, src: Path) -> None:
    """Every weight the output's index names is in the file it names, with the bytes the
    input holds for it."""
    stored = {}
    for path in src.glob("*.safetensors"):
        stored.update(peers.raw_tensors(path))
    indexed = indexed_tensors(out)
    for name, raw in stored.items():
        if not name.endswith(("k_scale", "v_scale", "q_scale")):
            assert indexed[name] == raw, name


def valid_report(layers: int = LAYERS) -> dict:
    """A calibration report as `kvcalib run` writes it (tests/calibrate/test_run_smollm2.py
    checks that a real one validates), with `layers` attention layers."""
    records = [{"layer": i, "module": f"model.layers.{i}.self_attn",
                **{f"{k}_{what}": [0.02, 0.03] for k in "kv" for what in ("scale", "absmax")}}
               for i in range(layers)]
    return {
        "schema_version": 1, "kvcalib_version": "0.1.0", "created": "2026-12-02T00:00:00+00:00",
        "model": {"source": "m", "path": "/m", "architecture": "LlamaForCausalLM",
                  "model_type": "llama"},
        "scheme": {"num_bits": 8, "type": "float", "format": "float8_e4m3fn", "fp8_max": 448.0,
                   "strategy": "attn_head", "q_scale": False, "observer": "static_minmax"},
        "dataset": {"source": "builtin", "config": None, "split": None, "text_column": "text",
                    "num_rows": 208, "seed": 0, "token_ids_sha256": "0" * 64,
                    "rows_used": [1, 2]},
        "samples": {"requested": 2, "used": 2, "max_seq_len": 128, "num_tokens": 256, "seed": 0},
        "pipeline": {"requested": "auto", "used": "basic", "reason": "fits"},
        "compute": {"device": "cpu", "dtype": "float32", "checkpoint_dtype": "bfloat16"},
        "versions": {"python": "3.11.7"}, "timings_s": {"load": 1.0}, "layers": records}
