"""Make tests/fixtures/peers/: what AMD Quark 0.13 and NVIDIA ModelOpt 0.47 really export
for SmolLM2, calibrated on the same 16 texts `kvcalib run --dataset builtin` uses.

Each export is written whole to --exports (150-270 MB each), then reduced to a fixture
small enough to commit: config.json, hf_quant_config.json when the tool writes one, the KV scale
tensors as the tool wrote them (scales.safetensors), and instead of the weights a
manifest of every tensor of the export (name, dtype, shape, sha256 of its bytes). The
KV-only exports keep SmolLM2's weights bit for bit, so tests/peers.py rebuilds them
exactly from the demo model (tests/verify/test_peer_engine.py starts vLLM on them).

The two packages cannot live in the project's environments (their pins conflict), so
this runs in a scratch virtual environment outside the repository:

    python3.11 -m venv /tmp/peers-env
    /tmp/peers-env/bin/pip install torch==2.13.0          # first: the CPU build
    /tmp/peers-env/bin/pip install amd-quark==0.13 nvidia-modelopt==0.47.0 \\
        transformers==5.17.0 datasets==5.2.0 accelerate safetensors
    PYTHONPATH=. /tmp/peers-env/bin/python scripts/make_peer_fixtures.py \\
        --model ~/.cache/kvcalib/models/SmolLM2-135M-Instruct --exports /tmp/peer-exports

kvcalib's own scales on the same texts, for comparison (in the project's environment):

    .venv/bin/kvcalib run --model SmolLM2 --output /tmp/peer-exports/kvcalib-tensor \
        --strategy tensor --dataset builtin --num-samples 16 --max-seq-len 512
    .venv/bin/python scripts/make_peer_fixtures.py --reduce /tmp/peer-exports/kvcalib-tensor

What each export runs (the calls the issue names; CPU, bf16, one sample per batch):
- quark-fp8:  LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8"),
              ModelQuantizer(cfg).quantize_model(model, loader),
              export_safetensors(model, out, custom_mode="quark") — pre-RoPE KV (default);
- quark-kv:   the same with exclude_layers=["*proj", "lm_head"] (KV cache only);
- quark-kv-post-rope: quark-kv with QConfig.kv_cache_post_rope = True;
- modelopt-fp8: mtq.quantize(model, FP8_DEFAULT_CFG + FP8_KV_CFG, forward_loop),
              export_hf_checkpoint(model, export_dir=out);
- modelopt-kv: the same with FP8_KV_CFG alone (weights left in bf16).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "peers"
NUM_SAMPLES, MAX_SEQ_LEN, SEED = 16, 512, 0
# Every KV scale name the four layouts use (kvcalib/layouts.py), matched independently of it.
SCALE_NAME = re.compile(r"\.(?:[kvq]|kv|output)_scale$")
CONFIG_FILES = ("config.json", "hf_quant_config.json")


def calibration_batches(model_dir: Path):
    """The token ids `kvcalib run --dataset builtin --num-samples 16 --max-seq-len 512`
    calibrates on (kvcalib.data chooses them), one (1, seq) tensor per sample."""
    import torch
    from transformers import AutoTokenizer

    from kvcalib import data

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = data.select_samples(data.DatasetSpec("builtin"), tokenizer, NUM_SAMPLES,
                                  MAX_SEQ_LEN, SEED)
    return [torch.tensor([ids]) for ids in samples.token_ids], samples.digest()


def load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def export_quark(model_dir: Path, out: Path, batches, kv_only: bool, post_rope: bool) -> None:
    import torch
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

    model = load(model_dir)
    exclude = {"exclude_layers": ["*proj", "lm_head"]} if kv_only else {}
    cfg = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", **exclude)
    cfg.kv_cache_post_rope = post_rope
    with torch.no_grad():
        model = ModelQuantizer(cfg).quantize_model(model, batches)
    export_safetensors(model, out, custom_mode="quark")


def export_modelopt(model_dir: Path, out: Path, batches, kv_only: bool) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant

    model = load(model_dir)
    base = {"quant_cfg": None} if kv_only else mtq.FP8_DEFAULT_CFG
    cfg = update_quant_cfg_with_kv_cache_quant(base, mtq.FP8_KV_CFG["quant_cfg"])

    def forward_loop(model) -> None:
        with torch.no_grad():
            for ids in batches:
                model(ids)

    model = mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, export_dir=out)


EXPORTS: dict[str, Callable] = {
    "quark-fp8": lambda m, o, b: export_quark(m, o, b, kv_only=False, post_rope=False),
    "quark-kv": lambda m, o, b: export_quark(m, o, b, kv_only=True, post_rope=False),
    "quark-kv-post-rope": lambda m, o, b: export_quark(m, o, b, kv_only=True, post_rope=True),
    "modelopt-fp8": lambda m, o, b: export_modelopt(m, o, b, kv_only=False),
    "modelopt-kv": lambda m, o, b: export_modelopt(m, o, b, kv_only=True),
}


def tensors_of(folder: Path) -> dict[str, tuple[Path, dict]]:
    """Every tensor of every safetensors file: its file and header entry."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        start = 8 + length
        for name, entry in header.items():
            found[name] = (path, {**entry, "start": start})
    return found


def reduce_to_fixture(export: Path, fixture: Path, versions: dict[str, str], digest: str) -> None:
    """Config files as exported, the scale tensors byte for byte, a manifest of the rest."""
    if fixture.exists():
        shutil.rmtree(fixture)
    fixture.mkdir(parents=True)
    for name in CONFIG_FILES:
        if (export / name).exists():
            shutil.copyfile(export / name, fixture / name)
    manifest, scales = [], {}
    for name, (path, entry) in sorted(tensors_of(export).items()):
        begin, end = entry["data_offsets"]
        with open(path, "rb") as f:
            f.seek(entry["start"] + begin)
            raw = f.read(end - begin)
        manifest.append([name, entry["dtype"], entry["shape"], hashlib.sha256(raw).hexdigest()])
        if SCALE_NAME.search(name):
            scales[name] = (entry["dtype"], entry["shape"], raw)
    write_safetensors(fixture / "scales.safetensors", scales)
    (fixture / "manifest.json").write_text(json.dumps(
        {"made_by": versions, "calibration_token_ids_sha256": digest,
         "files": sorted(p.name for p in export.glob("*.safetensors")),
         "tensors": manifest}, separators=(",", ":")) + "\n")


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file from raw bytes (numpy has no bfloat16 to go through)."""
    header, offset = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, _, raw in tensors.values():
            f.write(raw)


def main() -> None:
    from importlib import metadata

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--exports", type=Path,
                        help="Folder for the whole exports (kept, outside the repository).")
    parser.add_argument("--only", nargs="*", choices=sorted(EXPORTS), help="Just these.")
    parser.add_argument("--reduce", type=Path, help="Only reduce this kvcalib checkpoint to "
                        "a fixture of its folder's name.")
    args = parser.parse_args()
    if args.reduce:
        report = json.loads((args.reduce / "kvcalib_report.json").read_text())
        reduce_to_fixture(args.reduce, FIXTURES / args.reduce.name,
                          {"kvcalib": report["kvcalib_version"], **report["versions"]},
                          report["dataset"]["token_ids_sha256"])
        return
    if not (args.model and args.exports):
        parser.error("--model and --exports are needed to export")
    batches, digest = calibration_batches(args.model)
    for name in args.only or EXPORTS:
        out = args.exports / name
        if out.exists():
            shutil.rmtree(out)
        print(f"{name}: exporting to {out}", flush=True)
        EXPORTS[name](args.model, out, batches)
        tool = "amd-quark" if name.startswith("quark") else "nvidia-modelopt"
        versions = {p: metadata.version(p) for p in (tool, "torch", "transformers")}
        reduce_to_fixture(out, FIXTURES / name, versions, digest)
        print(f"{name}: fixture in {FIXTURES / name}", flush=True)


if __name__ == "__main__":
    main()
