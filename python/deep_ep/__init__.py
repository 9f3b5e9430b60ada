"""DeepEP's Python API (V1's, and V2's ElasticBuffer), served by EPX.

EPX's distribution (epx-moe) installs this package so that code written for
DeepEP runs with no change at all::

    from deep_ep import Buffer, Config
    from deep_ep.utils import EventHandle, EventOverlap
    from deep_ep import ElasticBuffer, EPHandle   # DeepEP V2 (docs/deepep_v2_api.md)

Every name is EPX's own object (``deep_ep.Buffer is epx.Buffer``); docs/python.md
and docs/deepep_compat.md say where EPX differs from DeepEP. DeepEP V2's
``ElasticBuffer`` serves its non-expanded dispatch and combine; what it refuses
(the expanded layout, the experimental Engram / PP / AGRS methods, ...) raises
EPXUnsupportedError naming the argument or method (docs/deepep_v2_api.md).
Names of other DeepEP releases that EPX does not provide (the hybrid-ep branch's
``HybridEPBuffer``) raise AttributeError naming them, so
``from deep_ep import HybridEPBuffer`` raises ImportError and ``hasattr`` sees
them as absent, as with a DeepEP build without them. Importing it needs neither
PyTorch nor a GPU (``topk_idx_t`` and ``Buffer`` need PyTorch).

DeepEP itself must not be installed in the same environment: both provide the
import name ``deep_ep``.
"""

from __future__ import annotations

import epx as _epx
from epx import Buffer, Config, ElasticBuffer, EPHandle, get_logical_domain_size, \
    get_physical_domain_size
from epx.utils import EventHandle, EventOverlap

from . import buffer, utils  # noqa: F401  (deep_ep.buffer, deep_ep.utils as attributes)

__version__ = _epx.__version__
#: Which implementation serves ``deep_ep`` (DeepEP has no such attribute).
BACKEND = "epx"
__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "ElasticBuffer",
           "EPHandle", "get_physical_domain_size", "get_logical_domain_size"]

# Public names of DeepEP releases that EPX does not implement, and where they come from.
# (DeepEP V2's ElasticBuffer, EPHandle and the domain-size helpers are provided above.)
_NOT_PROVIDED = {
    "HybridEPBuffer": "DeepEP's hybrid-ep branch",
}


def __getattr__(name: str):
    if name == "topk_idx_t":  # DeepEP's dtype of topk_idx: torch.int64 (resolved lazily)
        return _epx.topk_idx_t
    if name in _NOT_PROVIDED:
        raise AttributeError(f"deep_ep.{name} ({_NOT_PROVIDED[name]}) is not provided by EPX's "
                             f"deep_ep, which serves DeepEP V1's and V2's API: {', '.join(__all__)}")
    raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")
