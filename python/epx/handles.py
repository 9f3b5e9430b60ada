"""Handles shaped like DeepEP V1's: tuples whose elements are DeepEP's, in its
order, with EPX's own routing state riding along as ``.core``.

Code written for DeepEP indexes its handles (``handle[0]``, ``handle[1][i]``);
EPX's calls take the tuple back unchanged (or EPX's core handle, as before).
"""

from __future__ import annotations

from typing import Any

from . import _core


class LowLatencyHandle(tuple):
    """A low-latency dispatch's handle, DeepEP's 5-tuple:

    0. src_info: [E_local, R*maxT] int32, the source token index of each
       packed row (rows past an expert's count are -1);
    1. layout_range: [E_local, R] int64, ``(first row << 32) | rows`` of each
       source rank in an expert's packed rows;
    2. num_max_dispatch_tokens_per_rank; 3. hidden; 4. num_experts.

    ``.core`` is EPX's handle (the combine's reduction plan and the op's
    state); other attributes (``src_info``, ``num_tokens``, ...) read from it.
    """

    core: Any

    def __new__(cls, core: "_core.LowLatencyHandle", src_info: Any,
                layout_range: Any) -> "LowLatencyHandle":
        if not isinstance(core, _core.LowLatencyHandle):
            raise TypeError(f"core: expected an epx._core.LowLatencyHandle, "
                            f"got {type(core).__name__}")
        self = super().__new__(cls, (src_info, layout_range,
                                     core.num_max_dispatch_tokens_per_rank, core.hidden,
                                     core.num_experts))
        self.core = core
        return self

    def __getattr__(self, name: str) -> Any:
        # Only called for names the tuple lacks: EPX's handle attributes.
        if name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    def __reduce__(self):
        raise TypeError("an EPX handle refers to device state of one buffer and cannot be "
                        "pickled or copied")

    def __repr__(self) -> str:
        c = self.core
        return (f"epx.LowLatencyHandle(num_max_dispatch_tokens_per_rank="
                f"{c.num_max_dispatch_tokens_per_rank}, hidden={c.hidden}, "
                f"num_experts={c.num_experts}, num_ranks={c.num_ranks}, "
                f"num_tokens={c.num_tokens})")


def core_low_latency_handle(op: str, handle: Any) -> "_core.LowLatencyHandle":
    """EPX's handle inside ``handle`` (a LowLatencyHandle tuple or the core
    handle itself); a TypeError naming ``op`` and the argument otherwise."""
    if isinstance(handle, LowLatencyHandle):
        return handle.core
    if isinstance(handle, _core.LowLatencyHandle):
        return handle
    what = "a plain tuple (rebuilt from a handle's elements?)" if isinstance(handle, tuple) \
        else type(handle).__name__
    raise TypeError(f"{op}: handle: expected the handle returned by low_latency_dispatch, "
                    f"got {what}")
