"""pytest setup for the Python package tests.

`epx` is imported from the installed package, or else from python/ in this
checkout (a CMake build with EPX_BUILD_PYTHON=ON copies _core there).
GPU tests carry the `gpu` marker: run CPU tests alone with -m "not gpu".
"""

import os
import random
import sys

# The fuzz's seed (tests/python/test_fuzz.py): drawn once per run unless set,
# and shown in the report's header, so that a failure can be repeated with
# EPX_FUZZ_SEED=N.
_FUZZ_SEED_FROM_ENV = "EPX_FUZZ_SEED" in os.environ
os.environ.setdefault("EPX_FUZZ_SEED", str(random.SystemRandom().randrange(2**63)))

try:
    import epx  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))


def pytest_report_header(config):
    how = "from the environment" if _FUZZ_SEED_FROM_ENV else "drawn for this run"
    return f"EPX_FUZZ_SEED={os.environ['EPX_FUZZ_SEED']} ({how})"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs and PyTorch (multi-process tests)")
