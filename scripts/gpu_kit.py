"""Build the GPU kit: the Python 3.12 wheels a lent GPU machine lacks to run kvcalib's
calibration (`make gpu-kit`, into .gpu-kit/, git-ignored), and prove it complete.

    .venv/bin/python scripts/gpu_kit.py [--kit .gpu-kit]

The machine has no network and no llm-compressor; what it has is scripts/gpu_machine.txt.
1. Resolve kvcalib's calibration requirements (llm-compressor, compressed-tensors and the
   rest of [project].dependencies, by name) for CPython 3.12 on manylinux x86_64 with uv,
   the machine's known versions (torch 2.11, transformers 5.17, ...) forced.
2. Download every resolved wheel the machine does not have, and build kvcalib's wheel.
3. Install the kit with --no-deps into a scratch Python 3.12 environment, and check from
   the installed metadata that every requirement of every kit package is met by the kit
   or by the machine (at its known version where there is one). kvcalib's own exact pins
   are the CPU lock's; on the machine kvcalib is installed with --no-deps and its
   requirements are checked by name.
It writes .gpu-kit/kit.json (wheels, sizes, total) and prints the total.

On the machine: python3 -m pip install --no-index --no-deps .gpu-kit/*.whl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ROOT / "scripts" / "gpu_machine.txt"
PYTHON = "3.12"
PLATFORM = "x86_64-manylinux_2_28"
# The carry limit of the device tool: the working tree plus at most this much.
CARRY_LIMIT = 64 * 2**20
# The demo tokenizer (SmolLM2's, converted by `kvcalib demo-model`): the GPU check's model
# uses it, and the machine cannot fetch one.
TOKENIZER = Path.home() / ".cache" / "kvcalib" / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine() -> dict[str, str | None]:
    """name -> version (None where only the name is known)."""
    out: dict[str, str | None] = {}
    for line in MACHINE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version or None
    return out


def uv() -> str:
    found = sorted(ROOT.glob(".tools/uv-*/bin/uv"))
    return str(found[-1]) if found else shutil.which("uv") or "uv"


def requirements() -> list[str]:
    """kvcalib's calibration requirements, torch and the machine's packages unpinned."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    has = machine()
    return [req if canonical(re.split(r"[=<>!~ \[]", req)[0]) not in has
            else re.split(r"[=<>!~ ]", req)[0] for req in project["dependencies"]]


def resolve(tmp: Path) -> dict[str, str]:
    """The full resolution for the machine's Python and platform: name -> version."""
    (tmp / "req.in").write_text("\n".join(requirements()) + "\n")
    (tmp / "overrides.txt").write_text("".join(
        f"{name}=={version}\n" for name, version in machine().items() if version))
    done = subprocess.run(
        [uv(), "pip", "compile", str(tmp / "req.in"), "--overrides", str(tmp / "overrides.txt"),
         "--python-version", PYTHON, "--python-platform", PLATFORM, "--no-header",
         "--no-annotate", "--quiet"], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"uv could not resolve the kit:\n{done.stderr}")
    pins = [line.split("==") for line in done.stdout.splitlines() if "==" in line]
    return {canonical(name): version.strip() for name, version in pins}


def download(names: dict[str, str], kit: Path) -> None:
    pins = [f"{name}=={version}" for name, version in sorted(names.items())]
    # pip, not uv, downloads: uv has no download command. The system Python's pip (the
    # Makefile's $(PYTHON)), for another Python version and platform than its own.
    done = subprocess.run(
        [os.environ.get("PYTHON", "python3"), "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary", ":all:", "--python-version", PYTHON, "--implementation", "cp",
         "--abi", "cp312", "--abi", "abi3", "--abi", "none", "--platform",
         "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform",
         "manylinux2014_x86_64", "--platform", "any", "--dest", str(kit), *pins],
        capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"pip could not download the kit:\n{done.stderr[-3000:]}")
    subprocess.run([uv(), "build", "--wheel", "--quiet", "--out-dir", str(kit), str(ROOT)],
                   check=True)


def python312() -> str:
    """A Python 3.12 here ($KVCALIB_PYTHON312, pyenv's, or one on PATH that runs)."""
    candidates = [os.environ.get("KVCALIB_PYTHON312", ""),
                  *map(str, sorted(Path.home().glob(f".pyenv/versions/{PYTHON}*/bin/python3"))),
                  shutil.which(f"python{PYTHON}") or ""]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip() == "(3, 12)":
            return candidate
    raise SystemExit(f"no Python {PYTHON} here (set KVCALIB_PYTHON312): the kit's install "
                     "check needs the GPU machine's Python version")


def check_installed(kit: Path, tmp: Path) -> list[str]:
    """Install every kit wheel with --no-deps into a scratch Python 3.12 environment; the
    requirements its packages declare that neither the kit nor the machine meets."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    env = tmp / "scratch"
    subprocess.run([uv(), "venv", "--quiet", "--python", python312(), str(env)], check=True)
    subprocess.run([uv(), "pip", "install", "--quiet", "--python", str(env / "bin" / "python"),
                    "--no-deps", "--no-index", *map(str, sorted(kit.glob("*.whl")))],
                   check=True)
    site = next(env.glob("lib/python*/site-packages"))
    installed = {canonical(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    has = machine()
    marker_env = {"python_version": PYTHON, "python_full_version": "3.12.3",
                  "sys_platform": "linux", "platform_machine": "x86_64",
                  "platform_system": "Linux", "os_name": "posix",
                  "implementation_name": "cpython", "extra": ""}
    missing = []
    for name, dist in installed.items():
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate(marker_env):
                continue
            want = canonical(req.name)
            if want in installed:
                version = installed[want].version
            elif want in has:
                version = has[want]
            else:
                missing.append(f"{name} needs {req}: not in the kit, not on the machine")
                continue
            if name != "kvcalib" and version and req.specifier and \
                    not req.specifier.contains(Version(version), prereleases=True):
                missing.append(f"{name} needs {req}, the kit or machine has {version}")
    return missing


def build(kit: Path) -> dict:
    kit.mkdir(exist_ok=True)
    for old in kit.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        resolved = resolve(Path(tmp))
        has = machine()
        needed = {name: v for name, v in resolved.items() if name not in has}
        download(needed, kit)
        missing = check_installed(kit, Path(tmp))
    (kit / "tokenizer").mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (TOKENIZER / name).exists():
            shutil.copyfile(TOKENIZER / name, kit / "tokenizer" / name)
    wheels = sorted(kit.glob("*.whl"))
    summary = {"python": PYTHON, "platform": PLATFORM, "machine": str(MACHINE.relative_to(ROOT)),
               "wheels": [{"file": w.name, "bytes": w.stat().st_size} for w in wheels],
               "total_bytes": sum(f.stat().st_size for f in kit.rglob("*") if f.is_file()),
               "from_the_machine": sorted(set(resolved) & set(has)), "unmet": missing}
    (kit / "kit.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT / ".gpu-kit")
    args = parser.parse_args()
    summary = build(args.kit)
    total = summary["total_bytes"]
    print(f"{len(summary['wheels'])} wheels, {total / 2**20:.1f} MiB in {args.kit} "
          f"(the device tool carries at most {CARRY_LIMIT / 2**20:.0f} MiB)")
    for wheel in summary["wheels"]:
        print(f"  {wheel['file']}  {wheel['bytes'] / 2**20:.2f} MiB")
    for line in summary["unmet"]:
        print(f"  UNMET: {line}")
    return 1 if summary["unmet"] or total > CARRY_LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
