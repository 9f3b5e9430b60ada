"""pytest setup for the Python package tests.

`epx` is imported from the installed package, or else from python/ in this
checkout (a CMake build with EPX_BUILD_PYTHON=ON copies _core there).
GPU tests carry the `gpu` marker: run CPU tests alone with -m "not gpu".
"""

import os
import sys

try:
    import epx  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs and PyTorch (multi-process tests)")
