import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

from cupymoe import _compile  # noqa: E402


def pytest_configure(config):
    # scripts/sanitize.sh: every array its own cudaMalloc, so memcheck sees exact bounds and
    # initcheck fresh memory.
    if os.environ.get("CUPYMOE_TEST_NO_POOL") == "1" and _compile.gpu_available():
        import cupy

        cupy.cuda.set_allocator(None)


def pytest_collection_modifyitems(config, items):
    if _compile.gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[pytest.param("numpy"), pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module of the backend under test: NumPy (the reference), or CuPy (the kernels)."""
    if request.param == "numpy":
        return np
    import cupy

    return cupy
