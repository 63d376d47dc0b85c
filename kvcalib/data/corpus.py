"""The built-in offline corpus: real English text that ships with Python itself.

Two kinds of documents, both long enough for multi-thousand-token samples:
- the Python Language Reference topics from `pydoc_data.topics` (what `help()` shows);
- the docstrings of each public standard-library module, in source order.

Parsing the standard library takes seconds, so the corpus is built once per Python
version and cached as JSON lines under $KVCALIB_HOME/corpus.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

NAME = "builtin"
MIN_DOCUMENT_CHARS = 2000
_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"}


def kvcalib_home() -> Path:
    return Path(os.environ.get("KVCALIB_HOME", Path.home() / ".cache" / "kvcalib"))


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of a module, its classes and functions, in source order."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def _module_documents() -> Iterator[dict[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        private = any(p.startswith("_") and p != "__init__.py" for p in rel.parts)
        if private or _SKIP_PARTS.intersection(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        text = "\n\n".join(_docstrings(tree))
        if len(text) >= MIN_DOCUMENT_CHARS:
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            yield {"id": f"module:{module}", "text": text}


def _topic_documents() -> Iterator[dict[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        if len(topics[name]) >= MIN_DOCUMENT_CHARS:
            yield {"id": f"topic:{name}", "text": topics[name]}


def documents() -> list[dict[str, str]]:
    """All documents as {"id", "text"} rows, built once and cached."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    cache = kvcalib_home() / "corpus" / f"python-{version}.jsonl"
    if cache.exists():
        return [json.loads(line) for line in cache.read_text().splitlines()]
    rows = [*_topic_documents(), *_module_documents()]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(cache)
    return rows
