"""vLLM's KV-cache formats: kvcalib's math against vLLM's own code, element by element.

vLLM is the oracle. tests/vllm_oracle.py runs in the serving environment and calls vLLM's
pure-torch helpers (single_rht, the Lloyd-Max solver, ultraquant/reference.py), its Triton
store kernels through Triton's interpreter, its own dequantizers, and its KV spec classes.
Where vLLM has no code that runs on a CPU (NVFP4 lives in CUDA kernels), values are worked
out by hand from the cited kernels.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from conftest import TESTS, serving_python
from kvcalib.kvcache import formats as kvformats
from kvcalib.kvcache import quantize as kvquant
from kvcalib.kvcache import simulate as quantsim
from kvcalib.kvcache.formats import FORMATS
from kvcalib.kvcache.geometry import CacheShape as Geometry

ORACLE = TESTS / "vllm_oracle.py"
SHAPES = {"d64": (24, 3, 64), "d128": (12, 2, 128), "d96": (10, 2, 96)}
GEOMETRIES = [(heads, dim) for heads in (1, 4, 32) for dim in (64, 128, 256)]
TURBOQUANT = {"turboquant_k8v4": (None, 4), "turboquant_4bit_nc": (4, 4),
              "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3)}


def _kv(shape: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K/V with what real keys have: a few large channels, and one all-zero head."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=generator)
    keys[..., :3] *= 25.0
    values = torch.randn(shape, generator=generator) * 0.3
    keys[0, 0] = 0.0
    return keys.bfloat16(), values.bfloat16()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """One serving-environment run answers every question below."""
    folder = tmp_path_factory.mktemp("oracle")
    kv = {name: _kv(shape, seed) for seed, (name, shape) in enumerate(SHAPES.items())}
    query = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    keys, values = _kv((2 * 7, 3, 64), 11)
    request = {"kv": kv,
               "attention": (query, keys.view(2, 7, 3, 64), values.view(2, 7, 3, 64), 0.125),
               "lloyd_max": [(d, b) for d in (64, 128, 256) for b in (3, 4)],
               "page_bytes": [(name, h, d, torch.bfloat16) for name in FORMATS
                              for h, d in GEOMETRIES],
               "num_layers": [1, 2, 3, 4, 5, 30, 32]}
    torch.save(request, folder / "request.pt")
    done = subprocess.run([serving_python(), ORACLE, folder / "request.pt", folder / "result.pt"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return request, torch.load(folder / "result.pt")


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    mismatch = ours != theirs
    assert not mismatch.any(), (f"{int(mismatch.sum())} of {ours.numel()} differ, e.g. "
                                f"{ours[mismatch][:4].tolist()} vs {theirs[mismatch][:4].tolist()}")


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("integer", [False, True])
def test_fp8_and_int8_per_token_head_match_the_triton_kernel(oracle, name, integer):
    request, result = oracle
    theirs = result[name]["int8_per_token_head" if integer else "fp8_per_token_head"]
    for kind, states in zip("kv", request["kv"][name], strict=True):
        _same(kvquant.per_token_head(states, integer), theirs[kind])


@pytest.mark.parametrize("name", list(SHAPES))
def test_int4_per_token_head_matches_rotation_codes_scales_and_dequant(oracle, name):
    request, result = oracle
    theirs = result[name]["int4_per_token_head"]
    dim = SHAPES[name][-1]
    _same(kvquant.rht_signs(dim & -dim), theirs["signs"])
    for kind, states in zip("kv", request["kv"][name], strict=True):
        rotated = kvquant.randomized_hadamard(states.float()).to(states.dtype)
        _same(rotated, theirs[f"{kind}_rotated"])
        codes, zero, packed_scale = kvquant.int4_codes(rotated.float())
        _same(codes, theirs[f"{kind}_codes"])
        _same(zero, theirs[f"{kind}_zero"])
        _same(packed_scale.view(torch.int32).squeeze(-1), theirs[f"{kind}_scale_bits"])
        _same(kvquant.int4_per_token_head(states), theirs[kind])


@pytest.mark.parametrize(("dim", "bits"), [(d, b) for d in (64, 128, 256) for b in (3, 4)])
def test_lloyd_max_centroids_match_vllms_solver(oracle, dim, bits):
    _same(kvquant.lloyd_max_centroids(dim, bits), oracle[1]["lloyd_max"][(dim, bits)])


@pytest.mark.parametrize("name", ["d64", "d128"])
@pytest.mark.parametrize("preset", list(TURBOQUANT))
def test_turboquant_matches_the_store_and_dequant_kernels(oracle, name, preset):
    """Store kernel, then vLLM's _tq_full_dequant_kv: keys in the rotated basis, both fp16."""
    request, result = oracle
    keys, values = request["kv"][name]
    key_bits, value_bits = TURBOQUANT[preset]
    theirs = result[name][preset]
    _same(kvquant.turboquant_values(values, value_bits).half(), theirs["v"])
    if key_bits is not None:
        _same(kvquant.turboquant_rotated_keys(keys, key_bits, True).half(), theirs["k_rotated"])
        # and rotated back, keys are what the decode kernel's scores imply
        pit = kvquant.orthonormal_hadamard(keys.shape[-1])
        restored = kvquant.turboquant_keys(keys, key_bits, True)
        torch.testing.assert_close(restored @ pit, theirs["k_rotated"].float(),
                                   rtol=0, atol=2e-3 * float(keys.float().abs().max()))


def test_turboquant_k8v4_with_a_head_size_vllm_stores():
    """k8v4 keys are a bare k.to(float8e4nv): 0.3 -> 0.3125 (E4M3 steps of 2^-5 there),
    500 saturates to 448, 1e-4 is below E4M3's smallest subnormal (2^-9) and flushes."""
    keys = torch.tensor([0.3, -500.0, 1e-4, 3.0])
    assert kvquant.turboquant_fp8_keys(keys).tolist() == [0.3125, -448.0, 0.0, 3.0]


def test_turboquant_values_by_hand():
    """Min 0, max 15 over the head: step 1 (fp16-exact), codes int(v + 0.5) clamped."""
    values = torch.tensor([0.0, 15.0, 7.4, 7.5, 3.49])
    assert kvquant.turboquant_values(values, 4).tolist() == [0.0, 15.0, 7.0, 8.0, 3.0]
    # 3 bits over [0, 14]: step 2, codes int(v / 2 + 0.5)
    values = torch.tensor([0.0, 14.0, 6.9, 7.1, 2.0])
    assert kvquant.turboquant_values(values, 3).tolist() == [0.0, 14.0, 6.0, 8.0, 2.0]
    # min and step are stored as fp16: 0.1 + 15 steps of (1.6 - 0.1) / 15 = 0.1
    values = torch.tensor([0.1, 1.6])
    assert kvquant.turboquant_values(values, 4).tolist() == [
        torch.tensor(0.1).half().item(),
        15 * torch.tensor(0.1).half().item() + torch.tensor(0.1).half().item()]


@pytest.mark.parametrize("name", ["d64", "d128"])
def test_ultraquant_matches_the_reference_and_the_store_kernel(oracle, name):
    request, result = oracle
    keys, values = request["kv"][name]
    theirs = result[name]["ultraquant_4bit"]
    _same(kvquant.ultraquant_encode_decode(keys, rotate=True), theirs["k_rotated"])
    _same(kvquant.ultraquant_encode_decode(values, rotate=False), theirs["v"])
    _same(kvquant.ultraquant_encode_decode(values, rotate=False), theirs["v_kernel"])
    # The store kernel rotates with a butterfly (a 1/sqrt(2) per stage), the reference with
    # one matmul: in float32 a value can land on the other side of an FP4 midpoint.
    ours = kvquant.ultraquant_encode_decode(keys, rotate=True)
    differ = ours != theirs["k_rotated_kernel"]
    assert differ.float().mean() < 1e-3


def test_ultraquant_attention_matches_the_reference_attention(oracle):
    """reference_ultraquant_attention (rotated, FP8-cast Q against the encoded K/V) equals
    plain attention over kvcalib's dequantized K/V and FP8-haircut Q, in the input basis."""
    request, result = oracle
    query, keys, values, scale = request["attention"]
    k = kvquant.ultraquant_keys(keys.transpose(1, 2)).repeat_interleave(2, dim=1)
    v = kvquant.ultraquant_values(values.transpose(1, 2)).repeat_interleave(2, dim=1)
    q = kvquant.ultraquant_query(query)
    probs = torch.softmax(torch.einsum("bhd,bhnd->bhn", q, k) * scale, dim=-1)
    ours = torch.einsum("bhn,bhnd->bhd", probs, v)
    torch.testing.assert_close(ours.bfloat16(), result["ultraquant_attention"], rtol=0.02,
                               atol=0.02)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(("heads", "dim"), GEOMETRIES)
def test_page_bytes_match_vllms_spec_classes(oracle, name, heads, dim):
    """FullAttentionSpec(...).page_size_bytes after the backend's customize_spec, per
    16-token page: MHA, GQA and MQA head counts at head sizes 64, 128 and 256."""
    theirs = oracle[1]["page_bytes"][(name, heads, dim, str(torch.bfloat16))]
    assert 16 * FORMATS[name].bytes_per_token(Geometry(heads, dim)) == theirs


@pytest.mark.parametrize("num_layers", [1, 2, 3, 4, 5, 30, 32])
def test_boundary_layers_match_turboquants_config(oracle, num_layers):
    theirs = oracle[1]["boundary_layers"][num_layers]
    for name in (*TURBOQUANT, "ultraquant_4bit"):
        assert FORMATS[name].kept_layers(num_layers) == theirs
    assert FORMATS["nvfp4"].kept_layers(num_layers) == []
    assert FORMATS["turboquant_k8v4"].kept_layers(num_layers, hybrid=True) == []


# ----- NVFP4: no CPU code in vLLM or FlashInfer, so by hand from the kernels ----- #


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 100.0, -0.74, -2.6])
    assert kvquant.to_e2m1(x).tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
                                           -0.5, -3.0]


def test_nvfp4_block_by_hand():
    """amax 12 at global scale 1: block scale E4M3(12 / 6) = 2, codes x / 2 in E2M1."""
    block = torch.tensor([12.0, -12.0, 1.0, 0.9, 2.5, 5.0, 7.0, 0.5, 0, 0, 0, 0, 0, 0, 0, 3.0])
    assert kvquant.nvfp4(block, 1.0).tolist() == [12.0, -12.0, 1.0, 1.0, 2.0, 4.0, 8.0, 0.0,
                                                  0, 0, 0, 0, 0, 0, 0, 3.0]
    # global scale 0.5: the block scale is E4M3(12 / 3) = 4 and dequant multiplies by 4 · 0.5
    assert kvquant.nvfp4(block, 0.5).tolist() == kvquant.nvfp4(block, 1.0).tolist()
    # amax 7 / 6 = 1.1667 rounds to the E4M3 1.125: codes of x / 1.125, then x 1.125
    seven = torch.tensor([7.0, 1.0] + [0.0] * 14)
    assert kvquant.nvfp4(seven, 1.0)[:2].tolist() == [6 * 1.125, 1.125]


def test_nvfp4_tiny_values_at_scale_one_lose_their_block_scale():
    """At global scale 1.0 a block with amax 0.006 needs scale 0.001: E4M3's subnormals
    (steps of 2^-9) give 2^-9 = 0.00195, so 0.006 codes as 3 · 0.00195 = 0.00586;
    calibrated (amax / 2688 as ModelOpt), the same block keeps a normal scale."""
    block = torch.tensor([0.006, 0.001] + [0.0] * 14)
    assert kvquant.nvfp4(block, 1.0)[:2].tolist() == [3 * 2**-9, 0.5 * 2**-9]
    calibrated = kvformats.nvfp4_global_scale(0.006)
    assert calibrated == pytest.approx(0.006 / 2688)
    torch.testing.assert_close(kvquant.nvfp4(block, calibrated)[:2],
                               torch.tensor([0.006, 0.001]), rtol=0.1, atol=0)


def test_nvfp4_4over6_picks_max_over_4_when_it_fits_better():
    """[4, 3, 3, 3]: max/6 gives scale 4/6 -> E4M3 0.6875, codes 5.8 -> 6 and 4.4 -> 4 (error
    0.125² + 3 · 0.25²); max/4 gives scale exactly 1 and every value is a code (error 0)."""
    block = torch.tensor([4.0, 3.0, 3.0, 3.0] + [0.0] * 12)
    assert kvquant.nvfp4(block, 1.0)[:4].tolist() == [4.125, 2.75, 2.75, 2.75]
    assert kvquant.nvfp4(block, 1.0, four_over_six=True)[:4].tolist() == [4.0, 3.0, 3.0, 3.0]


# ----- hand checks of the other formats ----- #


def test_per_token_head_by_hand():
    """absmax 2.54: int8 scale 0.02 per (token, head); 1.0 / 0.02 = 50 exactly."""
    x = torch.tensor([2.54, 1.0, -0.011, 0.0])
    scale = (torch.tensor(2.54) / 127).item()
    out = kvquant.per_token_head(x, integer=True)
    # -0.011 / 0.02 = -0.55 rounds half away from zero to -1
    assert out.tolist() == pytest.approx([127 * scale, 50 * scale, -1 * scale, 0.0])
    assert kvquant.per_token_head(torch.zeros(4), integer=True).tolist() == [0.0] * 4


def test_int4_zero_point_lives_in_the_scale():
    """Range [-1, 14] over 15 steps: scale 1, zero point 1; the stored scale keeps the zero
    point in its low mantissa bits, which the reader masks off."""
    x = torch.tensor([-1.0, 14.0, 0.4, 0.5])
    codes, zero, packed = kvquant.int4_codes(x)
    assert codes.tolist() == [0.0, 15.0, 1.0, 2.0] and zero.item() == 1.0
    assert packed.view(torch.int32).item() == torch.tensor(1.0).view(torch.int32).item() | 1


# ----- the registry ----- #


def test_format_rules_say_why():
    smol = Geometry(3, 64)
    odd = Geometry(8, 96, "float16")
    assert FORMATS["turboquant_4bit_nc"].unsupported(odd) == (
        "turboquant's Hadamard rotation needs a power-of-2 head size (this model: 96)")
    assert FORMATS["turboquant_k8v4"].unsupported(odd) is None  # no rotation for fp8 keys
    assert "bfloat16" in FORMATS["ultraquant_4bit"].unsupported(Geometry(8, 128, "float16"))
    assert FORMATS["nvfp4"].unsupported(smol, "b200") is None
    assert "head size 64" in FORMATS["nvfp4"].unsupported(smol, "h100")
    assert FORMATS["nvfp4_4over6"].unsupported(Geometry(8, 128), "h100") == (
        "nvfp4_4over6 does not run on h100")
    assert "MLA" in FORMATS["nvfp4"].unsupported(Geometry(1, 576, mla=True))
    cpu = [name for name, f in FORMATS.items() if "cpu-avx512" in f.runs_on]
    assert cpu == ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    assert [name for name, f in FORMATS.items() if "cpu-avx2" in f.runs_on] == ["auto"]


def test_quantized_layers_leave_out_boundary_and_skip_layers():
    layers = list(range(30))
    tq = FORMATS["turboquant_k3v4_nc"]
    assert kvformats.quantized_layers(tq, layers, 30, skip=[5]) == set(range(2, 28)) - {5}
    assert kvformats.quantized_layers(FORMATS["fp8"], layers, 30) == set(layers)
    assert kvformats.quantized_layers(FORMATS["auto"], layers, 30) == set()


# ----- the simulated attention ----- #


class _Attention(torch.nn.Module):
    """The attention-module surface quantsim's hook uses."""

    def __init__(self):
        super().__init__()
        self.layer_idx = 0

        def sdpa(module, q, k, v, mask, **kwargs):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2), None

        self._kvcalib_original_attention = sdpa


def test_simulation_applies_a_format_and_keeps_the_first_chunk_exact():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 64, generator=generator) for _ in range(3))
    module = _Attention()
    fmt = FORMATS["turboquant_k3v4_nc"]
    sim = quantsim.Simulation(format=fmt, exact_prefix=4)
    with quantsim.simulate(sim):
        out, _ = quantsim._simulated_attention(module, q, k, v, None)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    stored = F.scaled_dot_product_attention(q, kvquant.turboquant_keys(k, 3, True),
                                            kvquant.turboquant_values(v, 4),
                                            is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out[:, :4], exact[:, :4], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 4:], stored[:, 4:], rtol=0, atol=0)
    assert (out[:, 4:] - exact[:, 4:]).abs().max() > 1e-3
    # static FP8 formats take the FP8 path, with the checkpoint's scales
    e5m2 = quantsim.Simulation(format=FORMATS["fp8_e5m2"], scales={0: {"k": torch.tensor(2.0)}})
    assert e5m2.fmt == "e5m2"
    with quantsim.simulate(e5m2):
        out, _ = quantsim._simulated_attention(module, q, k, v, None)
    expected = F.scaled_dot_product_attention(
        q, quantsim.fake_quantize(k, 2.0, "e5m2"), quantsim.fake_quantize(v, 1.0, "e5m2"),
        is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
