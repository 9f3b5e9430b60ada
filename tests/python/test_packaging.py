"""CPU tests of the packaging: the distribution's name and licence, the build
requirements an isolated `pip install .` relies on (the CMake CMakeLists.txt
needs, NCCL's wheel, the deep_ep package in the wheel), and the choice of Python
scripts/python_env.sh makes under PEP 668. scripts/check_clean_install.sh, run by
scripts/test.sh, does the install itself."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _version(text):
    return tuple(int(p) for p in text.split("."))


def test_distribution_name_and_licence():
    project = _pyproject()["project"]
    assert project["name"] == "epx-moe"  # "epx" is an unrelated project on PyPI
    assert project["license"] == {"text": "MIT"}
    assert "License :: OSI Approved :: MIT License" in project["classifiers"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("MIT License") and "The EPX authors" in text


def test_build_requires_the_cmake_that_cmakelists_needs():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"cmake_minimum_required\(VERSION ([0-9.]+)\)", f.read())
    needed = _version(m.group(1))
    assert needed >= (3, 28)  # nvcc's C++20 dialect
    spec = _pyproject()["tool"]["scikit-build"]["cmake"]["version"]
    if spec != "CMakeLists.txt":  # else scikit-build-core reads cmake_minimum_required itself
        lower = re.fullmatch(r">=\s*([0-9.]+)", spec)
        assert lower and _version(lower.group(1)) >= needed, spec


def test_isolated_build_has_nccl_and_ships_deep_ep():
    data = _pyproject()
    requires = data["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("nvidia-nccl-cu13==2.28.9") for r in requires)
    assert any(r.startswith("nanobind") for r in requires)
    packages = data["tool"]["scikit-build"]["wheel"]["packages"]
    assert "python/epx" in packages and "python/deep_ep" in packages
    assert "build-dir" not in data["tool"]["scikit-build"]  # isolated builds start afresh
    assert "hypothesis" in data["project"]["optional-dependencies"]["test"]


def _python_env(python3_dir, extra_env=None):
    """Runs scripts/python_env.sh's epx_use_python with `python3` resolving to the
    one in python3_dir (a temporary copy of the checkout's script, so no .venv
    is made here) and returns (status, EPX_PY, stderr)."""
    env = {"PATH": f"{python3_dir}:/usr/bin:/bin", **(extra_env or {})}
    script = os.path.join(ROOT, "scripts", "python_env.sh")
    cmd = f'source "{script}" && epx_needs_venv; echo "needs_venv=$?"'
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env)
    return r.returncode, r.stdout.strip(), r.stderr


def _bin_dir_with_python3(tmp_path, target):
    d = tmp_path / ("bin-" + target.replace("/", "_"))
    if not d.exists():
        d.mkdir()
        (d / "python3").symlink_to(target)
    return str(d)


def test_python_env_uses_an_open_python_as_it_is(tmp_path):
    # this interpreter: a virtual environment or one pip may install into (CI's pyenv)
    status, out, err = _python_env(_bin_dir_with_python3(tmp_path, sys.executable))
    assert status == 0, err
    assert out == "needs_venv=1"


def test_python_env_uses_a_venv_for_an_externally_managed_python(tmp_path):
    marked = [f"/usr/lib/python3.{m}/EXTERNALLY-MANAGED" for m in range(8, 20)]
    if not os.path.exists("/usr/bin/python3") or not any(os.path.exists(p) for p in marked):
        pytest.skip("no externally managed system Python (PEP 668) on this machine")
    status, out, err = _python_env(_bin_dir_with_python3(tmp_path, "/usr/bin/python3"))
    assert status == 0, err
    assert out == "needs_venv=0"
    # $PYTHON wins over the detection
    status, out, _ = _python_env(_bin_dir_with_python3(tmp_path, "/usr/bin/python3"),
                                 {"PYTHON": sys.executable})
    assert out == "needs_venv=1"
