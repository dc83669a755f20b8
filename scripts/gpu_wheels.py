"""Build the folder of wheels the GPU machine needs to run lmrl's suite and GPU benchmark.

The GPU machine (the device tool's nvidia-h100-x1 / nvidia-h200) has PyTorch, transformers, peft and
accelerate but reaches no package index, so what else lmrl needs travels with the working tree as
wheels, at most 64 MiB with the tree. This script, run here (where pip reaches the index):

1. walks lmrl's requirements (`pyproject.toml`: the dependencies and the dev / peft / bench extras, ruff
   left out) breadth first, for CPython 3.12 on manylinux x86_64: a package the machine's image has
   (`scripts/gpu_image.txt`) is taken as it is, so nothing there is replaced (a requirement its known
   version does not meet is printed as a warning); any other is downloaded as a wheel into `.whl/`
   (ignored by git) and its own requirements are walked in turn;
2. checks that the wheels fit the size limit (default 48 MiB, leaving room for the tree itself).

    python scripts/gpu_wheels.py                # download and check: prints what it carries

Then `scripts/gpu_run.sh` on the GPU machine installs them and runs the suite and the benchmark.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "scripts" / "gpu_image.txt"
PYTHON_VERSION = "3.12"  # the GPU image's python3
# pip matches a manylinux tag exactly: every glibc level a wheel of ours (or of torch's CUDA libraries, which
# the resolution reads but never downloads) may carry; the image is Ubuntu 24.04 (glibc 2.39)
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)), "manylinux2014_x86_64", "manylinux2010_x86_64",
             "manylinux1_x86_64")
EXTRAS = ("dev", "peft", "bench", "agents")
LEFT_OUT = ("ruff",)  # lint runs here, not on the GPU machine
LIMIT_MB = 48.0


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): `Huggingface_Hub` -> `huggingface-hub`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path = IMAGE) -> dict[str, str | None]:
    """The image's packages: normalised name -> version, or None where the version is not known."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalise(name)] = version or None
    return out


def requirements(pyproject: Path = ROOT / "pyproject.toml", extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """lmrl's dependencies and those of `extras`, without the ones the GPU machine does not need."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return sorted({r for r in reqs if normalise(re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0]) not in LEFT_OUT})


def platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


# the GPU machine's environment markers (`sys_platform == "linux"`, `python_version < "3.13"`, ...)
MARKERS = {"python_version": PYTHON_VERSION, "python_full_version": PYTHON_VERSION + ".3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def needed(requirement: str, extra: str = "") -> Requirement | None:
    """The requirement, or None when its marker leaves it out on the GPU machine (or it is an extra's other than
    `extra`, the one asked for: `pyjwt[crypto]` walks pyjwt's requirements with extra "crypto")."""
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({**MARKERS, "extra": extra}):
        return None
    return req


def wheel_requirements(wheel: Path) -> list[str]:
    """A wheel's Requires-Dist lines (its METADATA), markers and all."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def collect(reqs: list[str], image: dict[str, str | None], folder: Path, fetch=None) -> tuple[list[Path], list[str]]:
    """Download, breadth first, a wheel for every requirement the image does not satisfy, and theirs.

    A package the image has is taken as it is (its dependencies are the image's); where its version is
    known and a requirement excludes it, that is reported, not fixed (the image's torch stack stays).
    `fetch(requirement, folder) -> wheel path` downloads one wheel (default: `pip download --no-deps`).

    Returns the wheels and the conflicts with the image (one line each).
    """
    fetch = fetch or _pip_download
    wheels: dict[str, Path] = {}
    conflicts: list[str] = []
    walked: set[tuple[str, str]] = set()  # (package, extra) whose requirements are queued
    queue = [r for r in map(needed, reqs) if r is not None]
    while queue:
        req = queue.pop(0)
        name = normalise(req.name)
        if name in image:
            version = image[name]
            if version is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
                conflicts.append(f"{req} but the image has {name} {version}")
            continue
        if name not in wheels:  # its name and versions: the marker was evaluated here, the extras are walked below
            wheels[name] = fetch(f"{req.name}{req.specifier}", folder)
        for extra in ("", *sorted(req.extras)):  # its own requirements, then those of each extra asked for
            if (name, extra) not in walked:
                walked.add((name, extra))
                queue += [r for r in (needed(line, extra) for line in wheel_requirements(wheels[name])) if r is not None]
    return sorted(wheels.values()), conflicts


def _pip_download(requirement: str, folder: Path) -> Path:
    before = set(folder.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(folder), *platform_args(),
           requirement]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"gpu_wheels: no wheel for {requirement}: {run.stderr.strip().splitlines()[-1]}")
    new = set(folder.glob("*.whl")) - before
    if not new:  # already there from an earlier call
        key = normalise(Requirement(requirement).name).replace("-", "_")
        new = {p for p in folder.glob("*.whl") if normalise(p.name.split("-")[0]).replace("-", "_") == key}
    return next(iter(new))


def check_size(folder: Path, limit_mb: float = LIMIT_MB) -> float:
    """The wheels' total size in MiB; SystemExit naming the largest ones when it is over `limit_mb`."""
    wheels = sorted(folder.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    total = sum(p.stat().st_size for p in wheels) / 2**20
    if total > limit_mb:
        largest = ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in wheels[:3])
        raise SystemExit(f"gpu_wheels: {total:.1f} MiB of wheels, over the {limit_mb:g} MiB limit; largest: {largest}")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl)")
    parser.add_argument("--image", type=Path, default=IMAGE, help="the image's packages (name or name==version)")
    parser.add_argument("--limit-mb", type=float, default=LIMIT_MB)
    args = parser.parse_args(argv)
    for old in args.out.glob("*.whl"):
        old.unlink()
    args.out.mkdir(parents=True, exist_ok=True)
    wheels, conflicts = collect(requirements(), read_image(args.image), args.out)
    for line in conflicts:
        print(f"gpu_wheels: warning: {line}")
    print(f"carry {len(wheels)} wheels the image lacks: " + ", ".join(p.name.split("-")[0] + "==" + p.name.split("-")[1]
                                                               for p in wheels))
    print(f"{args.out}: {check_size(args.out, args.limit_mb):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
