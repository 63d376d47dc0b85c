"""The basic pipeline stops each forward pass once the last attention layer has been seen.

Nothing after it (the last MLP, the final norm, lm_head) runs, and no scale changes:
kvcalib's scales are byte for byte those of llm-compressor's own oneshot, run here
plainly on the whole model (what kvcalib did before stopping early).
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM

from conftest import builtin
from kvcalib.calibrate import ComputeOptions, ScaleOptions, calibrate
from kvcalib.calibrate.oneshot import stop_after
from reference import sample_token_ids, saved_scales


def test_nothing_after_the_last_attention_runs(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"),
                                                 attn_implementation="eager").eval()
    last = model.model.layers[-1]
    calls = {"attention": 0, "mlp": 0, "norm": 0, "lm_head": 0}
    for name, module in (("attention", last.self_attn), ("mlp", last.mlp),
                         ("norm", model.model.norm), ("lm_head", model.lm_head)):
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name,
                                                                             calls[name] + 1))
    keys = []
    for layer in model.model.layers:
        layer.self_attn.k_proj.register_forward_hook(lambda _m, _a, out: keys.append(out))
    ids = torch.tensor([list(range(5, 37))])
    with torch.no_grad():
        model(ids)
        full, keys[:] = list(keys), []
        assert calls == {"attention": 1, "mlp": 1, "norm": 1, "lm_head": 1}
        with stop_after(model, last.self_attn):
            assert model(ids) is None
    assert calls == {"attention": 2, "mlp": 1, "norm": 1, "lm_head": 1}
    assert all(torch.equal(a, b) for a, b in zip(full, keys, strict=True))
    assert "forward" not in vars(model)  # the model is left as it was


def test_scales_are_those_of_llm_compressor_on_the_whole_model(tiny_model, tmp_path):
    model_dir = tiny_model("qwen3")
    result = calibrate(model_dir, tmp_path / "out", scales=ScaleOptions(strategy="attn_head"),
                       samples=builtin(4, 48), compute=ComputeOptions(pipeline="basic"),
                       log=lambda _: None)
    out = result.output
    token_ids = sample_token_ids(out)
    # The dtype kvcalib computed in: the bf16 checkpoint's own where the CPU has bf16,
    # else float32 (kvcalib's --dtype auto); the scales are saved in bf16 either way.
    dtype = getattr(torch, result.report.compute.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation="eager")
    args = QuantizationArgs(num_bits=8, type="float", strategy="attn_head", dynamic=False,
                            symmetric=True, observer="static_minmax")
    rows = Dataset.from_dict({"input_ids": token_ids,
                              "attention_mask": [[1] * len(ids) for ids in token_ids]})
    oneshot(model=model, dataset=rows, recipe=[QuantizationModifier(
        ignore=["lm_head"], kv_cache_scheme=args)], max_seq_length=48,
        num_calibration_samples=len(token_ids), pipeline="basic",
        shuffle_calibration_samples=False)
    saved = saved_scales(out)
    assert len(saved) == 8
    for name, tensor in saved.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        theirs = getattr(module, name.rsplit(".", 1)[1]).detach().to(torch.bfloat16)
        assert torch.equal(tensor.view(torch.int16), theirs.reshape(tensor.shape).view(
            torch.int16)), name
