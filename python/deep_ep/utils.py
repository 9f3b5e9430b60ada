"""DeepEP's ``deep_ep.utils``, served by EPX's ``epx.utils``."""

from epx.utils import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
