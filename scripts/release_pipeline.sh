#!/usr/bin/env bash
# Example release pipeline: calibrate, prove, measure, then publish only if all pass.
#
#   scripts/release_pipeline.sh MODEL OUTPUT [KV_CACHE_DTYPE]
#
# MODEL is a local folder or hub id; OUTPUT the checkpoint to release. Each step is a
# gate: kvcalib exits 0 (ok), 1 (a check failed) or 2 (usage or environment error), and
# `set -e` stops the pipeline at the first non-zero exit. Reports land in OUTPUT.reports/.
# KV_CACHE_DTYPE defaults to fp8; use bfloat16 on CPUs that cannot run an FP8 KV cache
# in vLLM (then verify proves the scales load, not FP8 storage). KV_BUDGET, MAX_TTFT_MS
# and MAX_TPOT_MS set bench's budget and latency targets.
set -euo pipefail
model=${1:?usage: $0 MODEL OUTPUT [KV_CACHE_DTYPE]}
output=${2:?usage: $0 MODEL OUTPUT [KV_CACHE_DTYPE]}
kv_dtype=${3:-fp8}
reports="$output.reports"
mkdir -p "$reports"

# 1. Calibrate: per-KV-head scales on the default dataset (ultrachat_200k, 512 x 2048).
kvcalib run --model "$model" --output "$output" --strategy attn_head --overwrite \
    --json "$reports/calibration.json"

# 2. Prove the scales are present, sane and what vLLM actually loads.
kvcalib verify "$output" --kv-cache-dtype "$kv_dtype" \
    --json "$reports/verify.json" --junit "$reports/verify.junit.xml"

# 3. Measure the accuracy cost on held-out text and gate the release on it.
kvcalib eval "$output" --max-kl 0.02 --max-ppl-increase 0.02 --min-passkey 0.5 \
    --sweep --json "$reports/eval.json" --plot "$reports/eval.png"

# 4. Serving, in the real engine (section 5 of the chapter): capacity, latency and useful
#    concurrency at one KV budget, then long-context quality (RULER needle-in-a-haystack
#    through lm-eval). Each writes JSON and JUnit; each exits 1 when FP8 loses.
kvcalib bench "$output" --kv-budget "${KV_BUDGET:-1GiB}" --concurrency 1,4,16 \
    --max-ttft-ms "${MAX_TTFT_MS:-2000}" --max-tpot-ms "${MAX_TPOT_MS:-100}" \
    --json "$reports/bench.json" --junit "$reports/bench.junit.xml" --plot "$reports/bench.png"
kvcalib lm-eval "$output" --tasks niah_single_1 --lengths 1024,2048 --limit 50 \
    --min-recovery 0.95 --json "$reports/lm-eval.json" --junit "$reports/lm-eval.junit.xml" \
    --plot "$reports/lm-eval.png"

# 5. Keep a picture of the scales and the memory budget with the release, and write the
#    model card (front matter, provenance, every measured table with its command).
kvcalib inspect "$output" --plot "$reports/scales.png" > "$reports/scales.txt"
kvcalib estimate "$output" --budget 80GiB --json "$reports/capacity.json"
kvcalib card "$output" --eval "$reports/eval.json" --bench "$reports/bench.json" \
    --lm-eval "$reports/lm-eval.json"
echo "release candidate $output passed; reports in $reports (JUnit: $reports/*.junit.xml)"
