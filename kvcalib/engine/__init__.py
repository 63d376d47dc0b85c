"""The engine layer, below verify, eval, bench and lm-eval: vLLM in the serving environment.

interpreter (which Python serves, what it can run), process (a script started there and
every process it leaves ended), server (`vllm serve` on a local port), log (what vLLM's
log says), answers (the probes' answers, validated), compare (two runs on the same
prompts), and scripts/ (what runs inside the serving environment, over one request and
answer protocol, scripts/protocol.py).
"""
