"""Ranks as threads of one process: several EPX ranks on one GPU (or on the GPUs of
one process), with no torch.distributed group and no second process.

    import epx, torch

    def rank_main(comm):                 # runs on its own thread, once per rank
        buf = epx.Buffer(comm=comm, num_nvl_bytes=...)
        ...                              # dispatch / combine as with a process group

    epx.run_in_process(4, rank_main)     # 4 ranks on the current GPU

It is for tests and development where there are fewer GPUs than ranks: every rank's
traffic stays in that GPU's memory, so its speed says nothing about NVLink. Ranks on
one GPU split its SMs (docs/in_process.md). Each rank's thread works on a stream of
its own: the default (legacy) stream is shared by every thread and would order one
rank's waits behind another's. Set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts
(run_in_process warns otherwise): the ranks' streams need that many hardware queues.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
import warnings
from typing import Any, Callable, List, Optional, Sequence

from . import _core


class InProcessComm:
    """One in-process rank, with the mpi4py-style methods ``epx.Buffer(comm=...)`` uses."""

    def __init__(self, core_comm: "_core.Communicator") -> None:
        self._comm = core_comm

    @property
    def communicator(self) -> "_core.Communicator":
        return self._comm

    @property
    def device(self) -> int:
        return self._comm.device

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self._comm.rank

    def Get_size(self) -> int:  # noqa: N802
        return self._comm.num_ranks

    def barrier(self) -> None:
        self._comm.barrier()

    def allgather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order (collective over the ranks' threads)."""
        data = pickle.dumps(obj)
        sizes = self._comm.allgather(struct.pack("<q", len(data)))
        lengths = [struct.unpack_from("<q", sizes, 8 * r)[0] for r in range(self.Get_size())]
        width = max(lengths)
        everything = self._comm.allgather(data + b"\0" * (width - len(data)))
        return [pickle.loads(everything[r * width:r * width + n]) for r, n in enumerate(lengths)]


def in_process_comms(num_ranks: int, devices: Optional[Sequence[int]] = None,
                     timeout_s: float = 300.0) -> List[InProcessComm]:
    """``num_ranks`` in-process ranks: element r is rank r, on CUDA device ``devices[r]``
    (default: every rank on the current device). A barrier that waits longer than
    ``timeout_s`` raises EPXTimeoutError naming the ranks that did not arrive."""
    comms = _core.Communicator.create_in_process(int(num_ranks), list(devices or []),
                                                 float(timeout_s))
    return [InProcessComm(c) for c in comms]


def _warn_if_few_hardware_queues(comms: Sequence["InProcessComm"]) -> None:
    """Once per process: several ranks on one GPU with fewer than 32 hardware queues
    (CUDA_DEVICE_MAX_CONNECTIONS, default 8). Their streams then share queues, and a
    kernel queued behind another rank's waiting kernel can stall both until the
    deadline (4 ranks as 2x2 across virtual nodes did)."""
    global _warned_queues
    devices = [c.device for c in comms]
    if _warned_queues or len(devices) == len(set(devices)):
        return
    try:
        queues = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
    except ValueError:
        queues = 8
    if queues < 32:
        _warned_queues = True
        warnings.warn("epx.run_in_process: several ranks share a GPU with "
                      f"CUDA_DEVICE_MAX_CONNECTIONS={queues}; set it to 32 before CUDA starts "
                      "(a rank's kernel queued behind another rank's waiting one can stall "
                      "both until the deadline)", stacklevel=3)


_warned_queues = False


def run_in_process(num_ranks: int, fn: Callable[..., Any], *args: Any,
                   devices: Optional[Sequence[int]] = None, timeout_s: float = 300.0) -> List[Any]:
    """Runs ``fn(comm, *args)`` once per rank, each on its own thread with the rank's
    device current and a stream of its own; returns the results in rank order. If a
    rank raises, the first error (by rank) is raised here, with the rank in its message,
    once every thread has ended (a rank left waiting for a failed one gives up at its
    deadline)."""
    comms = in_process_comms(num_ranks, devices, timeout_s)
    _warn_if_few_hardware_queues(comms)
    results: List[Any] = [None] * len(comms)
    errors: List[Optional[BaseException]] = [None] * len(comms)

    def body(r: int) -> None:
        try:
            import torch

            torch.cuda.set_device(comms[r].device)
            with torch.cuda.stream(torch.cuda.Stream()):
                results[r] = fn(comms[r], *args)
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"epx-rank-{r}")
               for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The root cause first: a rank that failed on its own, not one that timed out
    # waiting for it. The exception keeps its type (EPXValueError, ...).
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = min(failed, key=lambda re: (isinstance(re[1], _core.EPXTimeoutError), re[0]))
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"(in-process rank {r} of {len(comms)}; {len(failed)} rank(s) failed)")
        raise e
    return results
