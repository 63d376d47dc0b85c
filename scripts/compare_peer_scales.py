"""Each tool's KV scales over kvcalib's, per layer (min / median / max over the layers and
the layer where the extreme is), for SmolLM2 calibrated on the same 16 builtin texts
(tests/fixtures/peers, made by scripts/make_peer_fixtures.py; the token ids' sha256 in each
manifest shows they are the same).

    .venv/bin/python scripts/compare_peer_scales.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvcalib.checkpoint import layouts, safetensors

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "peers"
REFERENCE = "kvcalib-tensor"


def scales(name: str) -> dict[tuple[int, str], float]:
    found, _ = layouts.find_scales(safetensors.file_tensors(FIXTURES / name, "scales.safetensors"))
    return {(s.layer, s.kind): float(safetensors.read_tensor(s.info).max()) for s in found}


def main() -> None:
    reference = scales(REFERENCE)
    layers = sorted({layer for layer, _ in reference})
    print(f"scale / {REFERENCE}'s, per layer over {len(layers)} layers")
    print(f"{'export':22} kind  {'min':>14} {'median':>7} {'max':>15}")
    for folder in sorted(FIXTURES.iterdir()):
        if folder.name == REFERENCE:
            continue
        theirs = scales(folder.name)
        for kind in ("k", "v"):
            ratio = np.array([theirs[(i, kind)] / reference[(i, kind)] for i in layers])
            low, high = int(ratio.argmin()), int(ratio.argmax())
            print(f"{folder.name:22} {kind:4}  {ratio[low]:7.3f} (L{layers[low]:<2}) "
                  f"{np.median(ratio):7.3f} {ratio[high]:7.3f} (L{layers[high]:<2})")


if __name__ == "__main__":
    main()
