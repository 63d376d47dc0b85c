"""Where a model comes from: a local folder, or a Hugging Face Hub id downloaded to (or
found in) the HF cache. Offline, fail fast instead of retrying for minutes."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvcalib.errors import UsageError
from kvcalib.reads import load_config

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a hub model download fetches (`estimate` fetches only config.json).
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub endpoint accepts a TCP connection (and offline mode is off)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def resolve_model(ref: str) -> Path:
    """A local folder as is, or a hub id downloaded to (or found in) the HF cache."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"model path {ref} is a file; pass the model's folder")
        if not (path / "config.json").is_file():
            raise UsageError(f"{ref} has no config.json: it is not a Hugging Face model folder")
        return path.resolve()
    _check_hub_id(ref)
    return _download(ref, MODEL_FILES)


def resolve_config(ref: str) -> dict[str, Any]:
    """config.json of a local folder, a config file itself, or a hub id (fetching only that
    file), for commands that need the model's shape but not its weights."""
    path = Path(ref).expanduser()
    if path.is_file():
        folder, name = path.parent, path.name
    elif path.is_dir():
        folder, name = path, "config.json"
    else:
        _check_hub_id(ref)
        folder, name = _download(ref, ["config.json"]), "config.json"
    return load_config(folder, name)


def _check_hub_id(ref: str) -> None:
    if not HUB_ID.match(ref) or ref.startswith((".", "/", "~")):
        raise UsageError(f"model folder not found: {ref}")


def _download(repo_id: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    offline = not hub_reachable()
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline)
    except Exception as exc:  # the hub client raises many types; all mean "not available"
        where = "the Hugging Face Hub cannot be reached and it is not in the local cache"
        if not offline:
            where = f"downloading it failed: {exc}"
        raise UsageError(f"model {repo_id!r} is not a local folder, and {where}") from exc
    return Path(folder)
