"""The wheel ships every module of cupymoe/ (the bench subpackage and its data too) and every kernel
source of kernels_cu/."""
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cupymoe

REPO = Path(__file__).resolve().parents[1]
MIN_SETUPTOOLS = 77  # reads pyproject's SPDX string `license = "..."` (PEP 639)
NOT_BUILD_INPUTS = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
    "tests", "benchmarks", "examples",
)


def setuptools_major():
    if importlib.util.find_spec("setuptools") is None:
        return None
    return int(importlib.metadata.version("setuptools").split(".")[0])


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    """The file names inside a wheel built from a copy of the checkout (no network)."""
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if pip.returncode != 0:
        pytest.skip("pip is not available")
    major = setuptools_major()
    if major is None or major < MIN_SETUPTOOLS:
        pytest.skip(f"building the wheel without isolation needs setuptools>={MIN_SETUPTOOLS}")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy, so the build leaves no build/ or *.egg-info in the checkout
    shutil.copytree(REPO, source, ignore=NOT_BUILD_INPUTS)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(tmp / "dist"), str(source)],
        capture_output=True, text=True,
    )
    if build.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{build.stdout}\n{build.stderr}")
    (wheel,) = (tmp / "dist").glob("cupymoe-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_checkout_has_kernel_sources():
    assert sorted((REPO / "kernels_cu").glob("*.cu")), "no .cu file in kernels_cu/"


def test_wheel_ships_kernel_sources(wheel_names):
    sources = sorted(p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources
    missing = [name for name in sources if f"cupymoe/kernels_cu/{name}" not in wheel_names]
    assert not missing, f"kernel sources missing from the wheel: {missing}"


def test_wheel_ships_modules_and_the_benchmarks_data(wheel_names):
    package = REPO / "cupymoe"
    files = sorted(str(p.relative_to(REPO)) for p in package.rglob("*")
                   if p.suffix in (".py", ".json", ".cu") and "__pycache__" not in p.parts)
    assert "cupymoe/bench/cases.json" in files and "cupymoe/bench/__main__.py" in files
    missing = [name for name in files if name not in wheel_names]
    assert not missing, f"files missing from the wheel: {missing}"


@pytest.mark.skipif(not os.environ.get("CUPYMOE_TEST_INSTALLED"), reason="set by .ci/run only")
def test_tests_import_the_installed_package():
    package = Path(cupymoe.__file__).resolve().parent
    assert REPO not in package.parents, f"imported the checkout ({package}), not the installed wheel"
    kernels = package / "kernels_cu"
    assert sorted(p.name for p in kernels.glob("*.cu")) == sorted(
        p.name for p in (REPO / "kernels_cu").glob("*.cu"))
