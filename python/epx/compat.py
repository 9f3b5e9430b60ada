"""How epx treats DeepEP arguments it cannot act on.

DeepEP V1 (and the branches frameworks use: antgroup-opt's overlapped combine,
hybrid-ep's NVFP4 dispatch) take arguments that mean nothing to EPX's
transports, or ask for features EPX does not have. Neither is ignored silently:

- an argument that changes only *how* DeepEP moves data (RDMA queue pairs,
  NVSHMEM's fabric memory, multi-node NVLink) gives one ``EPXIgnoredArgumentWarning``
  per argument per process when it is set to anything but DeepEP's default;
- an argument whose non-default value would change *what* the call returns
  (NVFP4, an extra return value, a compute-overlapped combine) raises
  ``EPXUnsupportedError`` naming the operation and the argument.

docs/deepep_compat.md lists every such argument.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from . import _core


class EPXIgnoredArgumentWarning(UserWarning):
    """A DeepEP argument EPX accepts but that has no effect on EPX."""


_warned: set = set()
_warned_lock = threading.Lock()


def warn_ignored_once(op: str, arg: str, why: str, stacklevel: int = 3) -> bool:
    """Warns once per (op, arg) per process that `arg` of `op` has no effect;
    returns whether this call warned."""
    key = (op, arg)
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(f"epx: {op}: {arg}: {why}", EPXIgnoredArgumentWarning, stacklevel=stacklevel)
    return True


def ignored_unless_default(op: str, arg: str, value: Any, default: Any, why: str) -> None:
    """Warns once (see warn_ignored_once) when `value` is not DeepEP's `default`."""
    if value is not default and value != default:
        warn_ignored_once(op, arg, why, stacklevel=4)


def unsupported(op: str, arg: str, why: str) -> None:
    """Raises EPXUnsupportedError "epx: <op>: <arg>: <why>"."""
    _core._raise(_core.ErrorCode.unsupported, f"{op}: {arg}: {why}")


def unsupported_unless_default(op: str, arg: str, value: Any, default: Any, why: str) -> None:
    """Raises EPXUnsupportedError naming `arg` when `value` is not `default`."""
    if value is not default and (default is None or value is None or value != default):
        unsupported(op, arg, why)


def _reset_for_tests() -> None:
    with _warned_lock:
        _warned.clear()
