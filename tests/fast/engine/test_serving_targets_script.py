"""scripts/serving_targets.py's guards that need no engine: a cited function is found by
its qualified name and its source is what the lock hashes, so an edit or a removal in a
newer wheel changes the check; and the message check of a refusal is in order."""

from __future__ import annotations

import pytest
import serving_targets

from kvcalib.engine.targets import TARGETS, Traits

SOURCE = '''
class Backend:
    @classmethod
    def supports(cls) -> bool:
        return False

def version() -> int:
    return 3
'''


def test_a_cited_function_is_its_own_source(tmp_path):
    path = tmp_path / "engine.py"
    path.write_text(SOURCE)
    assert serving_targets._function(path, "Backend.supports").startswith("    @classmethod")
    assert serving_targets._function(path, "version").strip().endswith("return 3")
    path.write_text(SOURCE.replace("return 3", "return 2"))
    assert "return 2" in serving_targets._function(path, "version")
    path.write_text(SOURCE.replace("def version", "def renamed"))
    with pytest.raises(SystemExit, match="version is gone"):
        serving_targets._function(path, "version")


def test_a_refusal_must_be_predicted_in_the_engines_words():
    ampere = TARGETS["vllm-ampere"].verdict(Traits(strategy="attn_head"))
    said = ("No valid attention backend found for cuda with AttentionSelectorConfig(head_size=64"
            ", use_per_head_quant_scales=True, x=1). Reasons: {FLASH_ATTN: [kv_cache_dtype not "
            "supported, per-head quant scales not supported, FP8 ...], TRITON: [...]}")
    assert serving_targets.agrees(ampere, {"starts": False, "message": said})
    assert not serving_targets.agrees(ampere, {"starts": False, "message": "another error"})
    assert not serving_targets.agrees(ampere, {"starts": True})
    served = TARGETS["vllm-hopper"].verdict(Traits(strategy="attn_head"))
    assert serving_targets.agrees(served, {"starts": True, "loaded": True})
    assert not serving_targets.agrees(served, {"starts": True, "loaded": False})
