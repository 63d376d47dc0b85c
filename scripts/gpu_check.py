"""The prepared GPU check: kvcalib's calibration on one GPU at the default 512 x 2048, on a
random-weight model of Llama-3.1-8B's exact shape, against llm-compressor's own KV-cache
example flow; writes gpu_check.json and gpu_check.md into --output.

    python3 scripts/gpu_check.py --output gpu-out          # on the GPU (docs/gpu.md)
    .venv/bin/python scripts/gpu_check.py --cpu-dry-run --output DIR   # tiny shape, CPU (CI)

Steps, each with its own time limit; once the budget (--budget, 470 s on the GPU) runs
short the remaining steps are skipped and the output says so:
1. model: the random bf16 model saved to local disk (timed), with the demo tokenizer;
2. speed: `kvcalib run` with its defaults (built-in corpus) and llm-compressor's example
   flow (oneshot with the same recipe, token ids and sample count, then save_pretrained),
   separate processes, alternately: wall time, peak GPU memory, peak RSS, the ratio, and
   whether the scales are the same;
3. compute bound: forward FLOPs over those tokens / the GPU's measured bf16 matmul rate,
   and kvcalib's time as a multiple of it;
4. memory plan: KVCALIB_DEVICE_MEMORY below the model's size: `auto` must choose
   sequential, give the basic pipeline's scales and stay within the plan's device peak
   (on the CPU dry run kvcalib must refuse instead: there the device is host memory);
5. FP8 rounding: torch's float8_e4m3fn conversion on the device against the simulation's
   rounding modes (kvcalib.kvcache.simulate), on the same tensors;
6. nccl: a single-rank torchrun job (gloo on the CPU) that must write the same scales.
Each kvcalib or llm-compressor process runs through this script's `--measure`, which
records its peak RSS and peak GPU memory.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
               "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 4096, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
RECIPE = ROOT / "recipes" / "fp8_kv_tensor.yaml"  # what `kvcalib run` builds by default


# ------------------------------------------------------------ measured child processes -- #

GROUP: dict[str, str] = {}  # the process group this child opened, if any


def _record_peaks(path: str) -> None:
    peaks: dict[str, Any] = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                             * 1024, **GROUP}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        peaks["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        peaks["gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
    Path(path).write_text(json.dumps(peaks))


def measure_child(what: str, argv: list[str]) -> None:
    """Run kvcalib's CLI or llm-compressor's example flow here; write the peaks at exit."""
    atexit.register(_record_peaks, os.environ["GPU_CHECK_PEAKS"])
    if os.environ.get("GPU_CHECK_GROUP"):
        # One rank of a torchrun job: kvcalib joins a group that exists (WORLD_SIZE=1
        # alone would make it skip torch.distributed altogether).
        import torch
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        GROUP["backend"] = str(dist.get_backend())
    if what == "kvcalib":
        from kvcalib.cli import main

        sys.argv = ["kvcalib", *argv]
        main()
    else:
        llmcompressor_example(*argv)


def llmcompressor_example(model_dir: str, out: str, samples: str, length: str) -> None:
    """llm-compressor's documented KV-cache flow (examples/quantization_kv_cache): load,
    oneshot with the recipe, save_pretrained; on kvcalib's token ids for the same count."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcalib.data import DatasetSpec, select_samples

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = select_samples(DatasetSpec("builtin"), tokenizer, int(samples), int(length),
                         seed=0).token_ids
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    oneshot(model=model, dataset=ds, recipe=str(RECIPE), max_seq_length=int(length),
            num_calibration_samples=len(ids))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def run_measured(what: str, argv: list[str], out_dir: Path, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, timeout: float = 600) -> dict[str, Any]:
    """One process: wall seconds, exit code, peaks, and its last output lines."""
    peaks = out_dir / f"peaks-{time.monotonic_ns()}.json"
    command = [*(launcher or [sys.executable]), __file__, "--measure", what, "--", *argv]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "GPU_CHECK_PEAKS": str(peaks)},
                          check=False)
    result = {"seconds": round(time.perf_counter() - started, 2), "exit": done.returncode,
              "stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
    if peaks.exists():
        result.update(json.loads(peaks.read_text()))
    return result


# --------------------------------------------------------------------------- the steps -- #

class Check:
    """The steps, their limits and the budget; what each measured goes into `results`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.output
        self.device = "cpu" if args.cpu_dry_run else "cuda"
        self.shape = TINY if args.cpu_dry_run else LLAMA_31_8B
        self.samples, self.length = (8, 64) if args.cpu_dry_run else (512, 2048)
        self.started = time.perf_counter()
        self.results: dict[str, Any] = {"mode": "cpu dry run" if args.cpu_dry_run else "gpu",
                                        "budget_s": args.budget, "steps": {}}
        self.model = self.out / "model"

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.started)

    def step(self, name: str, limit: float, body: Callable[[float], dict[str, Any]]) -> None:
        if self.left() < limit:
            self.results["steps"][name] = {"status": "skipped", "why": f"{self.left():.0f} s "
                                           f"of the budget left, the step may take {limit:.0f}"}
            return
        started = time.perf_counter()
        try:
            outcome = body(limit)
            status = "pass" if outcome.pop("ok", True) else "fail"
        except subprocess.TimeoutExpired:
            outcome, status = {"why": f"over its {limit:.0f} s limit"}, "timeout"
        except Exception as exc:  # a step's failure is its result
            outcome, status = {"why": f"{type(exc).__name__}: {exc}"}, "error"
        outcome.update(status=status, seconds=round(time.perf_counter() - started, 2),
                       limit_s=limit)
        self.results["steps"][name] = outcome
        print(f"{name}: {status} in {outcome['seconds']} s", flush=True)

    def kvcalib(self, out: str, *extra: str, limit: float, **kw: Any) -> dict[str, Any]:
        argv = ["run", "--model", str(self.model), "--output", str(self.out / out),
                "--dataset", "builtin", "--overwrite", "--json", str(self.out / f"{out}.json"),
                *extra]
        if self.args.cpu_dry_run:
            argv += ["--num-samples", str(self.samples), "--max-seq-len", str(self.length)]
        return run_measured("kvcalib", argv, self.out, timeout=limit, **kw)

    # 1
    def build_model(self, limit: float) -> dict[str, Any]:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        started = time.perf_counter()
        config = LlamaConfig(**self.shape)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = model.to_empty(device=self.device)
        torch.manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.02)
        built = time.perf_counter() - started
        model.save_pretrained(self.model)
        for name in TOKENIZER_FILES:
            if (self.args.tokenizer / name).exists():
                shutil.copyfile(self.args.tokenizer / name, self.model / name)
        params = sum(p.numel() for p in model.parameters())
        return {"parameters": params, "bytes": 2 * params, "build_s": round(built, 2),
                "save_s": round(time.perf_counter() - started - built, 2)}

    # 2
    def speed(self, limit: float) -> dict[str, Any]:
        runs: dict[str, list[dict[str, Any]]] = {"kvcalib": [], "llmcompressor": []}
        per_run = limit / (2 * self.args.repeats)
        for repeat in range(self.args.repeats):
            runs["kvcalib"].append(self.kvcalib(f"kvcalib-{repeat}", limit=per_run))
            runs["llmcompressor"].append(run_measured(
                "llmcompressor", [str(self.model), str(self.out / f"llmc-{repeat}"),
                                  str(self.samples), str(self.length)], self.out,
                timeout=per_run))
        ok = all(r["exit"] == 0 for rs in runs.values() for r in rs)
        ratios = [k["seconds"] / m["seconds"] for k, m in zip(*runs.values(), strict=True)]
        same = ok and same_scales(self.out / "kvcalib-0", self.out / "llmc-0")
        return {"runs": runs, "wall_ratio": ratios, "same_scales": same, "ok": ok and same}

    # 3
    def compute_bound(self, limit: float) -> dict[str, Any]:
        import torch

        n = 2048 if self.args.cpu_dry_run else 8192
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        started, reps = time.perf_counter(), 5 if self.args.cpu_dry_run else 50
        for _ in range(reps):
            a @ a
        sync()
        rate = 2 * n**3 * reps / (time.perf_counter() - started)
        s = self.shape
        head = s["hidden_size"] // s["num_attention_heads"]
        kv = s["num_key_value_heads"] * head
        per_layer = (2 * s["hidden_size"] * (s["hidden_size"] + kv)  # q, o and k, v
                     + 3 * s["hidden_size"] * s["intermediate_size"])
        tokens = self.samples * self.length  # at most: samples are truncated to the length
        # 2 FLOPs per weight per token; eager attention's QK^T and PV over the whole S x S.
        flops = (2 * per_layer * s["num_hidden_layers"] * tokens
                 + 4 * s["num_hidden_layers"] * s["num_attention_heads"] * head
                 * self.length**2 * self.samples)
        bound = flops / rate
        runs = self.results["steps"].get("speed", {}).get("runs", {}).get("kvcalib", [])
        times = [r["seconds"] for r in runs if r.get("exit") == 0]
        return {"matmul_tflops": round(rate / 1e12, 3), "forward_flops": f"{flops:.3e}",
                "bound_s": round(bound, 4),
                "kvcalib_x_bound": [round(t / bound, 2) for t in times]}

    # 4
    def memory_plan(self, limit: float) -> dict[str, Any]:
        model_bytes = self.results["steps"]["model"]["bytes"]
        cap = {"KVCALIB_DEVICE_MEMORY": f"{int(model_bytes * 0.6)}B"}
        few = [] if self.args.cpu_dry_run else ["--num-samples", "16"]
        capped = self.kvcalib("capped", *few, limit=limit / 2, env=cap)
        if self.args.cpu_dry_run:  # on a CPU the device is host memory: sequential saves none
            said = next((line for line in capped["stderr"].splitlines()
                         if "does not fit" in line), "")
            return {"capped": capped, "refused": said[:300],
                    "ok": capped["exit"] == 2 and bool(said)}
        basic = self.kvcalib("basic", *few, "--pipeline", "basic", limit=limit / 2)
        report = json.loads((self.out / "capped.json").read_text()) if capped["exit"] == 0 \
            else {}
        promised = (report.get("memory") or {}).get("needed")
        used = report.get("pipeline", {}).get("used")
        within = promised is not None and capped.get("gpu_reserved_bytes", 0) <= promised
        same = capped["exit"] == basic["exit"] == 0 and same_scales(self.out / "capped",
                                                                     self.out / "basic")
        return {"capped": capped, "basic": basic, "pipeline": used, "promised_bytes": promised,
                "peak_over_promised": capped.get("gpu_reserved_bytes", 0) / promised
                if promised else None, "same_scales": same,
                "ok": used == "sequential" and same and within}

    # 5
    def fp8_rounding(self, limit: float) -> dict[str, Any]:
        import torch

        from kvcalib.kvcache.simulate import fake_quantize

        torch.manual_seed(0)
        x = torch.randn(1 << 20) * torch.logspace(-3, 3, 1 << 20)  # every binade of E4M3
        scale = 0.5
        device = (x.to(self.device) / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        engine = device.float().cpu() * scale
        agree = {mode: float((fake_quantize(x, scale, rounding=mode) == engine).float().mean())
                 for mode in ("nearest", "toward_zero")}
        return {"device": self.device, "values": x.numel(), "agreement": agree,
                "ok": agree["nearest"] == 1.0 if self.device == "cuda" else True}

    # 6
    def single_rank(self, limit: float) -> dict[str, Any]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                    "--master-port", "29533"]
        few = [] if self.args.cpu_dry_run else ["--num-samples", "16"]
        ranked = self.kvcalib("ranked", *few, "--pipeline", "basic", limit=limit,
                              launcher=torchrun, env={"GPU_CHECK_GROUP": "1"})
        reference = self.out / ("basic" if not self.args.cpu_dry_run else "kvcalib-0")
        report = json.loads((self.out / "ranked.json").read_text()) if ranked["exit"] == 0 \
            else {}
        backend = (report.get("distributed") or {}).get("backend") or ranked.get("backend")
        same = ranked["exit"] == 0 and same_scales(self.out / "ranked", reference)
        return {"run": ranked, "backend": backend, "same_scales": same,
                "ok": same and backend == ("gloo" if self.args.cpu_dry_run else "nccl")}

    def run(self) -> dict[str, Any]:
        # Seconds on the GPU (x3 on the dry run); 460 in all, within the 470 s budget.
        limits = {"model": 90, "speed": 240, "compute_bound": 15, "memory_plan": 60,
                  "fp8_rounding": 10, "nccl": 45}
        for name, body in (("model", self.build_model), ("speed", self.speed),
                           ("compute_bound", self.compute_bound),
                           ("memory_plan", self.memory_plan),
                           ("fp8_rounding", self.fp8_rounding), ("nccl", self.single_rank)):
            self.step(name, limits[name] * (3 if self.args.cpu_dry_run else 1), body)
        self.results["seconds"] = round(time.perf_counter() - self.started, 1)
        self.results["versions"] = versions()
        return self.results


def same_scales(a: Path, b: Path) -> bool:
    """Every k_scale and v_scale of two checkpoints equal in value, by tensor name."""
    from safetensors.torch import load_file

    def scales(folder: Path) -> dict[str, Any]:
        found = {}
        for path in folder.glob("*.safetensors"):
            found.update({k: v.float().flatten() for k, v in load_file(path).items()
                          if k.endswith(("k_scale", "v_scale"))})
        return found

    mine, theirs = scales(a), scales(b)
    return bool(mine) and mine.keys() == theirs.keys() and all(
        mine[k].equal(theirs[k]) for k in mine)


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for package in ("kvcalib", "torch", "transformers", "llmcompressor", "compressed-tensors"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    import torch

    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# GPU check ({results['mode']})", "",
             f"{results['seconds']} s of a {results['budget_s']} s budget; "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), "",
             "| step | status | seconds | limit | result |", "|---|---|---|---|---|"]
    for name, step in results["steps"].items():
        shown = {k: v for k, v in step.items() if k not in ("status", "seconds", "limit_s",
                                                           "runs", "capped", "basic", "run")}
        lines.append(f"| {name} | {step['status']} | {step.get('seconds', '')} | "
                     f"{step.get('limit_s', '')} | {json.dumps(shown)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="the same steps on a tiny shape on the CPU (what CI runs)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all steps (default 470 on the GPU, 900 dry)")
    parser.add_argument("--repeats", type=int, default=1, help="speed pairs, alternating")
    parser.add_argument("--tokenizer", type=Path,
                        default=Path.home() / ".cache" / "kvcalib" / "models" /
                        "SmolLM2-135M-Instruct", help="folder with the demo tokenizer's files")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.measure:
        measure_child(args.measure, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    if args.output is None:
        parser.error("--output is required")
    args.budget = args.budget or (900 if args.cpu_dry_run else 470)
    args.output.mkdir(parents=True, exist_ok=True)
    results = Check(args).run()
    (args.output / "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.output / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    return 0 if all(s["status"] == "pass" for s in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
