"""The fast tier's guard: with this folder on PYTHONPATH, importing torch or vLLM fails.

Python imports `sitecustomize` at startup, so the guard holds in pytest and in every
`kvcalib` command a test runs. A None entry in sys.modules makes `import torch` raise
ModuleNotFoundError and `importlib.util.find_spec("torch")` return None, as if torch
were not installed (libraries that merely probe for it carry on without it).
"""

import sys

for name in ("torch", "vllm"):
    sys.modules[name] = None
