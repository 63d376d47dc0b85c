"""Shared fixtures: the real demo model, tiny random models, calibrated checkpoints.

Expensive things (model conversion, calibrations, vLLM engine starts) are session
fixtures, so each happens once per test run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

KVCALIB = Path(sys.executable).parent / "kvcalib"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def run_kvcalib(*args: object, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed `kvcalib` console script, as a user or pipeline would."""
    return subprocess.run([str(KVCALIB), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from kvcalib.demo_model import prepare_demo_model

    return prepare_demo_model()


def _tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":  # q_norm / k_norm before RoPE
        return tf.Qwen3Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "gemma2":  # alternating sliding-window and global layers, logit softcapping
        return tf.Gemma2Config(**common, sliding_window=16)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2)
    if arch == "mamba":  # no attention layers at all
        return tf.MambaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                              state_size=8)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, demo_model) -> Callable[[str], Path]:
    """Build (once per architecture) a tiny random bf16 model folder with the demo tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch))
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.to(torch.bfloat16).save_pretrained(folder)
            for name in TOKENIZER_FILES:
                shutil.copyfile(demo_model / name, folder / name)
            built[arch] = folder
        return built[arch]

    return build


def _calibrate_demo(tmp_path_factory, demo_model: Path, name: str, *args: str) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / name
    result = run_kvcalib("run", "--model", demo_model, "--output", out, "--dataset", "builtin",
                         "--num-samples", 6, "--max-seq-len", 128, *args)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def smol_tensor_q(tmp_path_factory, demo_model) -> Path:
    """SmolLM2 calibrated through the CLI: per-tensor k/v scales plus q_scale."""
    return _calibrate_demo(tmp_path_factory, demo_model, "smol-tensor-q", "--strategy", "tensor",
                           "--q-scale")


@pytest.fixture(scope="session")
def smol_attn_head(tmp_path_factory, demo_model) -> Path:
    """SmolLM2 calibrated through the CLI: per-KV-head scales."""
    return _calibrate_demo(tmp_path_factory, demo_model, "smol-attn-head", "--strategy",
                           "attn_head")


@pytest.fixture(autouse=True, scope="session")
def _quiet_libraries():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
