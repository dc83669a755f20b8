"""scripts/gpu_wheels.py: what the GPU machine's wheel folder holds is what lmrl needs and the image lacks.

Resolving and downloading need the package index; `python scripts/gpu_wheels.py` does both (the closing
note of the GPU issue gives its output). Here: the parts that decide what travels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_wheels)


def test_the_image_list_reads_names_and_known_versions():
    image = gpu_wheels.read_image()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"
    assert image["huggingface-hub"] == "1.33.0"  # the pip list's huggingface_hub, normalised
    assert "peft" in image and image["peft"] is None  # present, version not recorded
    assert "pydantic" not in image and "math-verify" not in image  # what lmrl must carry


def test_requirements_are_the_projects_without_the_linter():
    reqs = gpu_wheels.requirements()
    names = {gpu_wheels.normalise(r.split(">")[0].split("=")[0].split("<")[0]) for r in reqs}
    assert {"torch", "transformers", "pydantic", "math-verify", "datasets", "pytest", "peft", "trl"} <= names
    assert "ruff" not in names


def test_what_the_image_lacks_is_collected_with_its_requirements_and_nothing_else(tmp_path):
    import zipfile

    requires = {  # a small index: each package's Requires-Dist lines
        "pydantic": ["annotated-types>=0.6", "pydantic-core==2.50.5", "typing-extensions>=4.6",
                     'tzdata; sys_platform == "win32"', 'email-validator>=2; extra == "email"'],
        "pydantic-core": ["typing-extensions>=4.14"], "annotated-types": [], "math-verify": ["latex2sympy2-extended"],
        "latex2sympy2-extended": ["sympy", 'antlr4-python3-runtime; python_version >= "3.8"'],
        "antlr4-python3-runtime": [], "mcp": ["pyjwt[crypto]>=2.10"],
        "pyjwt": ['cryptography>=3.4; extra == "crypto"', 'sphinx; extra == "docs"'], "cryptography": [],
    }
    fetched = []

    def fetch(requirement, folder):
        name = gpu_wheels.normalise(gpu_wheels.Requirement(requirement).name)
        fetched.append(requirement)
        wheel = folder / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{name}-1.0.dist-info/METADATA",
                       "Name: x\n" + "".join(f"Requires-Dist: {r}\n" for r in requires[name]))
        return wheel

    image = {"torch": "2.11.0", "typing-extensions": None, "sympy": None, "transformers": "5.17.0"}
    wheels, conflicts = gpu_wheels.collect(["torch>=2.4", "pydantic>=2.6", "math-verify>=0.7", "transformers>=6", "mcp"],
                                           image, tmp_path, fetch=fetch)
    assert [w.name.split("-")[0] for w in wheels] == ["annotated_types", "antlr4_python3_runtime", "cryptography",
                                                      "latex2sympy2_extended", "math_verify", "mcp", "pydantic",
                                                      "pydantic_core", "pyjwt"]
    assert not any("sphinx" in f for f in fetched)  # an extra asked for (pyjwt[crypto]) brings its own only
    assert fetched[:2] == ["pydantic>=2.6", "math-verify>=0.7"]  # the image's torch is not downloaded
    assert not any("tzdata" in f or "email" in f for f in fetched)  # Windows-only and extras' requirements
    assert conflicts == ["transformers>=6 but the image has transformers 5.17.0"]


def test_the_size_limit_names_the_largest_wheels(tmp_path):
    (tmp_path / "big-1.0-py3-none-any.whl").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "small-1.0-py3-none-any.whl").write_bytes(b"x" * 2**20)
    assert gpu_wheels.check_size(tmp_path, limit_mb=5) == pytest.approx(4.0)
    with pytest.raises(SystemExit, match=r"4.0 MiB of wheels, over the 3.5 MiB limit; largest: "
                                         r"big-1.0-py3-none-any.whl \(3.0 MiB\), small"):
        gpu_wheels.check_size(tmp_path, limit_mb=3.5)
