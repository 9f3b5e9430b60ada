"""EPX: expert-parallel communication for Mixture-of-Experts models.

The Python API is DeepEP V1's, so existing code runs unchanged with::

    import epx as deep_ep

    buffer = deep_ep.Buffer(group, num_nvl_bytes=..., num_rdma_bytes=...)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(...)

EPX also installs a ``deep_ep`` package that serves the same objects, so code
that imports ``deep_ep`` (and ``deep_ep.utils``) needs no change at all.
DeepEP V2's ``ElasticBuffer`` / ``EPHandle`` (non-expanded dispatch and combine on
the same kernels) are here too: docs/deepep_v2_api.md.
Importing epx does not import torch; ``epx.Buffer`` needs it. See docs/python.md.
"""

from __future__ import annotations

import sys

from . import _core
from ._core import EPXError, EPXTimeoutError, EPXUnsupportedError, EPXValueError
from .buffer import Buffer
from .compat import EPXIgnoredArgumentWarning
from .config import Config
from .elastic import EPHandle, ElasticBuffer, get_logical_domain_size, get_physical_domain_size
from .handles import DispatchHandle, InternodeDispatchHandle, LowLatencyHandle
from .in_process import InProcessComm, in_process_comms, run_in_process
from .utils import EventHandle, EventOverlap

__version__ = _core.__version__
__all__ = [
    "Buffer", "Config", "EventHandle", "EventOverlap", "EPXError", "EPXValueError",
    "EPXTimeoutError", "EPXUnsupportedError", "EPXIgnoredArgumentWarning", "topk_idx_t",
    "alias_deep_ep", "InProcessComm", "in_process_comms", "run_in_process", "LowLatencyHandle", "DispatchHandle",
    "InternodeDispatchHandle", "ElasticBuffer", "EPHandle", "get_physical_domain_size",
    "get_logical_domain_size",
]


def __getattr__(name: str):
    if name == "topk_idx_t":  # DeepEP's dtype of topk_idx, resolved lazily (needs torch)
        from .utils import _torch

        return _torch().int64
    raise AttributeError(f"module 'epx' has no attribute {name!r}")


def alias_deep_ep() -> None:
    """Makes ``import deep_ep``, ``deep_ep.buffer`` and ``deep_ep.utils`` resolve to epx
    itself, unless a ``deep_ep`` is imported already. Kept for code written before
    EPX installed its ``deep_ep`` package, which serves the same objects."""
    from . import buffer, utils

    sys.modules.setdefault("deep_ep", sys.modules[__name__])
    sys.modules.setdefault("deep_ep.buffer", buffer)
    sys.modules.setdefault("deep_ep.utils", utils)
