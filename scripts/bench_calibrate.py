#!/usr/bin/env python3
"""Benchmark `kvcalib run`: speed and memory against plain transformers, memory against
model size, and the output step on a 70B-shaped checkpoint.

    .venv/bin/python scripts/bench_calibrate.py [--sections speed,memory,output]
        [--num-samples 16] [--max-seq-len 512] [--repeats 3] [--dir DIR]

Every ratio comes from measurements of this run. Each timed command is its own process.

- speed: `kvcalib run` on SmolLM2-135M (the demo model, basic pipeline) against a plain
  process that loads the same model, runs a no_grad forward over the same token ids
  (transformers' default attention sdpa, and eager, the attention llm-compressor
  calibrates under) and saves it with save_pretrained. Both tokenize with kvcalib.data.
  kvcalib runs as it does by default (eager attention, weights copied), with hard-linked
  weights, and with those and `--attention sdpa`. Whole-process wall time, CPU time and
  peak RSS, `--repeats` times interleaved; median and range of the ratios to plain
  (sdpa). Targets: at most 0.85x the plain process's time and 1.1x its peak RSS.
- memory: a random-weight Llama of about 2 GB made here (15 layers of width 2048 and
  MLP 8192, tied embeddings of the demo tokenizer's 49,152 tokens): peak RSS of
  `--pipeline basic` and `--pipeline sequential` against its size, and the error
  `kvcalib run` gives before loading when the memory it may use (KVCALIB_DEVICE_MEMORY) is
  too small.
- output: `run`'s output step (atomic_output_dir + write_checkpoint) on the 70B-shaped
  checkpoint of scripts/bench_verify.py (sparse files, ~141 GB declared), with --weights
  link and reflink (when the filesystem of --dir clones): bytes written to storage (from
  /proc/self/io) and seconds. Target: under 1 MB and 1 s.
  Copying is measured on one 4.7 GB shard and scaled to the checkpoint (XFS and btrfs
  clone in copy_file_range, so there copy writes nothing either).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvcalib.demo import prepare_demo_model
from kvcalib.tables import table
from kvcalib.text import size

KVCALIB = Path(sys.executable).parent / "kvcalib"
SCRIPTS = Path(__file__).resolve().parent

# The plain process: what a user would run to push the same tokens through the model.
PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvcalib.data import DatasetSpec, select_samples
model_dir, out, samples, length, attention = sys.argv[1:6]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
token_ids = select_samples(DatasetSpec("builtin"), tokenizer, int(samples), int(length),
                           seed=0).token_ids
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=sys.argv[6],
                                             attn_implementation=attention).eval()
with torch.no_grad():
    for ids in token_ids:
        model(torch.tensor([ids]))
model.save_pretrained(out)
"""


def timed(command: list[str], env: dict[str, str] | None = None, expect: int = 0,
          ) -> tuple[float, float, int, str, str]:
    """(wall seconds, CPU seconds, peak RSS bytes, stdout, stderr) of one process, which
    must exit with `expect`. CPU time (user + system) is what the process computed: on a
    machine shared with other jobs it varies far less than wall time."""
    with tempfile.TemporaryFile("w+") as errors:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True,
                                   env=env)
        stdout = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        errors.seek(0)
        stderr = errors.read()
    if os.waitstatus_to_exitcode(status) != expect:
        raise SystemExit(f"exit {os.waitstatus_to_exitcode(status)}: {' '.join(command)}\n"
                         f"{stderr[-3000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, stdout, stderr


def spread(values: list[float]) -> str:
    """Median and range, e.g. '0.84 (0.81-0.88)'."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def bench_speed(args: argparse.Namespace, tmp: Path) -> None:
    model_dir = prepare_demo_model()
    kvcalib = [str(KVCALIB), "run", "--model", str(model_dir), "--dataset", "builtin",
               "--num-samples", str(args.num_samples), "--max-seq-len", str(args.max_seq_len),
               "--pipeline", "basic", "--overwrite", "--json", "-"]
    runs: dict[str, list[tuple[float, float, int]]] = {}
    report = None
    for repeat in range(args.repeats):
        # kvcalib first: its report tells the plain process the compute dtype
        for name in ("kvcalib run", "kvcalib run --weights link",
                     "kvcalib run --weights link --attention sdpa", "plain (sdpa)",
                     "plain (eager)"):
            out = str(tmp / "speed")
            if name.startswith("plain"):
                command = [sys.executable, "-c", PLAIN, str(model_dir), out,
                           str(args.num_samples), str(args.max_seq_len), name[7:-1],
                           report["compute"]["dtype"]]
            else:
                command = [*kvcalib, "--output", out, *name.split()[2:]]
            seconds, cpu, rss, stdout, _ = timed(command)
            if not name.startswith("plain"):
                report = json.loads(stdout)
            runs.setdefault(name, []).append((seconds, cpu, rss))
            print(f"  repeat {repeat + 1}: {name}: {seconds:.1f} s wall, {cpu:.1f} s CPU, "
                  f"{size(rss)}", flush=True)
    base = runs["plain (sdpa)"]
    rows = []
    for name, values in runs.items():
        pairs = list(zip(values, base, strict=True))
        rows.append([name, spread([v[0] for v in values]), spread([v[1] for v in values]),
                     spread([v[0] / b[0] for v, b in pairs]),
                     spread([v[1] / b[1] for v, b in pairs]),
                     size(statistics.median(v[2] for v in values)),
                     spread([v[2] / b[2] for v, b in pairs])])
    print(f"\nspeed: SmolLM2-135M, {report['samples']['used']} samples, "
          f"{report['samples']['num_tokens']} tokens, {report['compute']['dtype']} on "
          f"{report['compute']['device']}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}"
          f", {len(base)} repeats interleaved (median, range; ratios pair each repeat)")
    print(table(["process", "wall s", "CPU s", "wall x plain", "CPU x plain", "peak RSS",
                 "RSS x plain"], rows))


def random_llama(folder: Path, demo: Path) -> None:
    """A random bf16 Llama of about 2 GB with the demo tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=15, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(demo / name, folder / name)


def bench_memory(args: argparse.Namespace, tmp: Path) -> None:
    import multiprocessing

    folder = tmp / "llama-2gb"
    # Built in a child process: a child's peak RSS counts its parent's at the fork.
    builder = multiprocessing.get_context("spawn").Process(
        target=random_llama, args=(folder, prepare_demo_model()))
    builder.start()
    builder.join()
    model_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    common = [str(KVCALIB), "run", "--model", str(folder), "--dataset", "builtin",
              "--num-samples", str(args.memory_samples), "--max-seq-len",
              str(args.memory_seq_len), "--overwrite", "--weights", "link", "--json", "-"]
    rows = []
    for pipeline in ("basic", "sequential"):
        _, _, rss, stdout, _ = timed([*common, "--output", str(tmp / pipeline),
                                      "--pipeline", pipeline])
        planned = json.loads(stdout)["memory"]["needed"]
        rows.append([pipeline, size(rss), f"{rss / model_bytes:.2f}", size(planned),
                     f"{planned / rss:.2f}"])
    print(f"\nmemory: random Llama, {size(model_bytes)} of bf16 weights, "
          f"{args.memory_samples} samples x {args.memory_seq_len} tokens")
    print(table(["pipeline", "peak RSS", "x model size", "kvcalib plans for",
                 "plan / peak"], rows))
    env = {**os.environ, "KVCALIB_DEVICE_MEMORY": "2GiB"}
    seconds, _, rss, _, stderr = timed([*common, "--output", str(tmp / "refused")], env=env,
                                       expect=2)
    print(f"with KVCALIB_DEVICE_MEMORY=2GiB: exit 2 after {seconds:.1f} s, peak RSS "
          f"{size(rss)}: {stderr.strip().splitlines()[-1]}")


def bytes_written() -> int:
    """Bytes this process has had written to storage so far (Linux /proc/self/io
    write_bytes: counted as page-cache pages are dirtied, so a copy-on-write clone or a
    hard link counts nothing, and a copy its size)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/self/io")


def output_step(model_dir: Path, target: Path, mode: str) -> tuple[float, int]:
    """Seconds and bytes written by run's output step, with every scale a new tensor."""
    from kvcalib.checkpoint import open_model, write_checkpoint
    from kvcalib.checkpoint.safetensors import raw
    from kvcalib.writes import atomic_output_dir

    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": raw(torch.full((8, 1, 1), 0.01,
                                                                          dtype=torch.bfloat16))
              for i in range(80) for kind in "kv"}
    written, started = bytes_written(), time.perf_counter()
    with atomic_output_dir(target) as tmp:
        write_checkpoint(tmp, open_model(model_dir), scales, config, weights=mode)
    return time.perf_counter() - started, bytes_written() - written


def bench_output(args: argparse.Namespace, tmp: Path) -> None:
    from kvcalib.checkpoint.write import choose_placement, place
    from kvcalib.errors import UsageError

    spec = importlib.util.spec_from_file_location("bench_verify", SCRIPTS / "bench_verify.py")
    bench_verify = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_verify)
    where = Path(tempfile.mkdtemp(dir=args.dir))
    folder = where / "llama-70b-shaped"
    declared = bench_verify.build(folder)
    rows = []
    for mode in ("link", "reflink"):
        try:
            choose_placement(mode, [next(folder.glob("*.safetensors"))], where)
        except UsageError:
            rows.append([mode, "-", "-", "this filesystem cannot clone (try --dir on XFS/btrfs)"])
            continue
        seconds, written = output_step(folder, where / mode, mode)
        rows.append([mode, f"{seconds:.2f}", f"{written / 1e3:.1f} kB", ""])
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    written, started = bytes_written(), time.perf_counter()
    place(shard, where / "one-shard-copy", "copy")
    seconds, written = time.perf_counter() - started, bytes_written() - written
    scale = declared / shard.stat().st_size
    rows.append(["copy", f"~{seconds * scale:.0f}", f"~{written * scale / 1e9:.0f} GB",
                 f"one {shard.stat().st_size / 1e9:.1f} GB shard, scaled: {seconds:.1f} s, "
                 f"{written / 1e9:.1f} GB"])
    print(f"\noutput step: 70B-shaped checkpoint ({declared / 1e9:.1f} GB declared, "
          f"{bench_verify.SHARDS} shards) in {where}")
    print(table(["--weights", "seconds", "written", "note"], rows))
    import shutil

    shutil.rmtree(where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="speed,memory,output")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-samples", type=int, default=4)
    parser.add_argument("--memory-seq-len", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the output step writes (its filesystem decides reflink)")
    args = parser.parse_args()
    sections = {"speed": bench_speed, "memory": bench_memory, "output": bench_output}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            sections[name](args, Path(tmp))


if __name__ == "__main__":
    main()
