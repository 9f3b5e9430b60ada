"""CUDA events for overlapping communication with compute (DeepEP's deep_ep.utils).

``EventHandle`` is a CUDA event recorded on the current PyTorch stream;
``EventOverlap`` wraps one (or none) and keeps tensors alive until the current
stream has waited for it. Importing this module does not import torch.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence, Tuple

from . import _core

_torch_module = None


def _torch():
    """The torch module, imported on first use (epx imports without torch)."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("epx.Buffer, CUDA events and topk_idx_t need PyTorch "
                              "(pip install torch)") from e
        _torch_module = torch
    return _torch_module


def _current_stream() -> int:
    return _torch().cuda.current_stream().cuda_stream


class EventHandle:
    """A CUDA event; ``EventHandle()`` records one on ``torch.cuda.current_stream()``."""

    __slots__ = ("_handle",)

    def __init__(self, event: Optional[_core.EventHandle] = None) -> None:
        self._handle = event if event is not None else _core.EventHandle.record(_current_stream())

    def current_stream_wait(self) -> None:
        """Makes ``torch.cuda.current_stream()`` wait for the event (the host does not block)."""
        self._handle.current_stream_wait(_current_stream())

    def synchronize(self) -> None:
        """Blocks the host until the event has completed."""
        self._handle.synchronize()


class EventOverlap:
    """An optional event plus tensors to keep alive until the current stream waits for it.

    Returned by every ``Buffer`` operation. Without ``async_finish`` the event is
    None: the operation is already ordered before later work on the current
    stream. Use ``with`` to overlap work on the current stream with the
    communication; leaving the block makes the current stream wait::

        _, _, _, _, _, event = buffer.dispatch(..., async_finish=True)
        with event:
            other_compute()   # runs concurrently with the dispatch
        # the current stream now waits for the dispatch

    ``extra_tensors`` plays the role of ``record_stream`` and works under CUDA
    graph capture: the tensors are released once the current stream has waited.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Sequence[Any]] = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        """Makes ``torch.cuda.current_stream()`` wait for the event (nothing if there is none)."""
        if self.event is not None:
            self.event.current_stream_wait()
        self.extra_tensors = None

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.current_stream_wait()


def _event_of(previous_event: Any) -> Optional[_core.EventHandle]:
    """The core event behind ``previous_event`` (EventOverlap, EventHandle or None)."""
    ev = previous_event
    if isinstance(ev, EventOverlap):
        ev = ev.event
    if ev is None:
        return None
    if isinstance(ev, EventHandle):
        return ev._handle
    if isinstance(ev, _core.EventHandle):
        return ev
    raise TypeError("previous_event: expected an EventOverlap, EventHandle or None, "
                    f"got {type(previous_event).__name__}")


def _wrap_event(ev: Optional[_core.EventHandle], extra_tensors=None) -> EventOverlap:
    return EventOverlap(EventHandle(ev) if ev is not None else None, extra_tensors)


INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
SIZE = (0, 2**64 - 1)


def _int(name: str, value: Any, bounds: Tuple[int, int] = INT32) -> int:
    """``value`` as an int: TypeError naming the argument when it is not one,
    EPXValueError naming it when it does not fit the C++ type (``bounds``)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if not bounds[0] <= v <= bounds[1]:
        _core._raise(_core.ErrorCode.invalid_argument,
                     f"{name}: must be an integer in [{bounds[0]}, {bounds[1]}] (got {v})")
    return v


def _pairs_without_nvlink(uuids: Sequence[str], nvml: Any) -> list:
    """The pairs (i, j), i < j, of GPUs (NVML UUIDs) that NVML does not report as
    NVLink peers. `nvml` is the pynvml module (or a stand-in with its calls)."""
    handles = [nvml.nvmlDeviceGetHandleByUUID(u) for u in uuids]
    missing = []
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            status = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j],
                                                 nvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status != nvml.NVML_P2P_STATUS_OK:
                missing.append((i, j))
    return missing


def check_nvlink_connections(group: Any) -> None:
    """DeepEP's ``deep_ep.utils.check_nvlink_connections``: fails unless every pair of
    GPUs of ``group`` is connected by NVLink.

    As in DeepEP, only PCIe GPUs are checked (SXM GPUs of one node reach each other
    over NVLink): a group of PCIe GPUs may have at most 2 ranks, and NVML (the
    ``pynvml`` module, needed only then) must report NVLink between them. Collective
    over ``group`` in that case. Raises ``EPXUnsupportedError`` naming the GPUs.
    """
    torch = _torch()
    if "PCIE" not in torch.cuda.get_device_name().upper():
        return
    if group.size() > 2:
        _core._raise(_core.ErrorCode.unsupported,
                     f"check_nvlink_connections: group: PCIe GPUs have pairwise NVLink at "
                     f"most, so the group may have 2 ranks (got {group.size()})")
    import torch.distributed as dist

    try:
        import pynvml
    except ImportError as e:
        raise ImportError("check_nvlink_connections: PCIe GPUs are checked through NVML; "
                          "pip install nvidia-ml-py (the pynvml module)") from e
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuids = [None] * group.size()
    dist.all_gather_object(uuids, f"GPU-{props.uuid}", group)
    pynvml.nvmlInit()
    try:
        missing = _pairs_without_nvlink(uuids, pynvml)
    finally:
        pynvml.nvmlShutdown()
    if missing:
        i, j = missing[0]
        _core._raise(_core.ErrorCode.unsupported,
                     f"check_nvlink_connections: group: GPUs {uuids[i]} (rank {i}) and "
                     f"{uuids[j]} (rank {j}) are not connected by NVLink")
