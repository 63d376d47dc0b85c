"""kvcalib: calibrate, verify and evaluate FP8 KV-cache scales for vLLM checkpoints.

The pipeline's stages are packages, each exporting its entry point and options:
kvcalib.data -> calibrate -> checkpoint -> verify -> evaluate -> report, over kvcache (the
cache's shape, formats and math), with a thin cli. Every package exports its names
lazily (`exports`), so that importing one module loads nothing else: light commands
(`verify --static-only`, `estimate`, `inspect`) start fast and without torch.
"""

from collections.abc import Callable
from importlib import import_module
from typing import Any

__version__ = "0.1.0"


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """A package's `__getattr__` and `__all__` for `names` (public name -> the module of
    `package` that defines it), each imported on first use (PEP 562)."""
    def attribute(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{names[name]}"), name)

    return attribute, sorted(names)
