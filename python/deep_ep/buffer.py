"""DeepEP's ``deep_ep.buffer``, served by EPX's ``epx.buffer``."""

from epx.buffer import Buffer

__all__ = ["Buffer"]
