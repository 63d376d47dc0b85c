"""`vllm serve` on a free port of 127.0.0.1, for the commands that measure serving."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvcalib.engine.log import parse_log
from kvcalib.engine.process import end_process_group

ENGINE_FAILED = "EngineCore failed to start"  # vllm/v1/engine/core.py's last word


class ServerFailed(Exception):
    """The server did not start, died, or did not complete its work."""


@contextlib.contextmanager
def serve(python: str, folder: Path, args: list[str], log_path: Path,
          timeout: float) -> Iterator[str]:
    """`vllm serve` (vLLM's OpenAI server module) with `args`, in a process group of its
    own, ended on the way out; yields its base URL once /health answers."""
    port = _free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(port), *args]
    # The legacy variable would override a --kv-cache-memory-bytes budget on CPU
    # (vllm/platforms/cpu.py).
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONUNBUFFERED"] = "1"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env, cwd=tempfile.gettempdir())
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while not _healthy(url):
                # The API server stays up when its engine dies at start: the log says so.
                failed = ENGINE_FAILED in log_path.read_text(errors="replace")
                if failed or process.poll() is not None or time.monotonic() > deadline:
                    facts = parse_log(log_path.read_text(errors="replace"))
                    why = (facts.hardware or facts.root_cause
                           or (f"exited with code {process.returncode}"
                               if process.returncode is not None
                               else f"not ready within {timeout:g} s (--timeout)"))
                    raise ServerFailed(f"vllm serve did not start: {why.splitlines()[-1]}")
                time.sleep(1)
            yield url
        finally:
            end_process_group(process)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
