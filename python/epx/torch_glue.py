"""How ``epx.Buffer`` meets PyTorch: tensors as the core's views (DLPack), streams, the
caching allocator for outputs, and the results back as tensors."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from . import _core
from .utils import _torch

if TYPE_CHECKING:  # pragma: no cover
    import torch

_GLUE_LOCK = threading.Lock()


class _TorchGlue:
    """Torch-dependent conversions, built once on first use."""

    _instance: Optional["_TorchGlue"] = None

    def __init__(self) -> None:
        torch = _torch()
        from torch.utils import dlpack

        self.torch = torch
        self.to_dlpack = dlpack.to_dlpack
        self.fp8 = torch.float8_e4m3fn
        try:  # older PyTorch cannot export float8 through DLPack: move the bits as uint8
            self.to_dlpack(torch.empty(1, dtype=self.fp8))
            self.fp8_dlpack = True
        except Exception:
            self.fp8_dlpack = False
        D = _core.DType
        self.alloc_dtypes = {  # the allocator gets DType values as ints
            D.bfloat16.value: torch.bfloat16,
            D.float8_e4m3fn.value: self.fp8 if self.fp8_dlpack else torch.uint8,
            D.float32.value: torch.float32,
            D.int32.value: torch.int32,
            D.int64.value: torch.int64,
            D.bool.value: torch.bool,
        }

        # torch dtype -> DType for the fast path of view() (CUDA tensors only)
        self.view_dtypes = {
            torch.bfloat16: D.bfloat16, torch.float32: D.float32, torch.int32: D.int32,
            torch.int64: D.int64, torch.bool: D.bool, self.fp8: D.float8_e4m3fn,
            torch.uint8: D.float8_e4m3fn,
        }
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:  # pragma: no cover - very old PyTorch
            def raw(index):
                return torch.cuda.current_stream(index).cuda_stream
        self.raw_stream = raw

    def current_stream(self, device: "torch.device") -> int:
        """The cudaStream_t of torch's current stream on ``device``, as an int (what
        ``torch.cuda.current_stream(device).cuda_stream`` returns, for less host time)."""
        index = device.index
        return self.raw_stream(self.torch.cuda.current_device() if index is None else index)

    @classmethod
    def get(cls) -> "_TorchGlue":
        if cls._instance is None:
            with _GLUE_LOCK:  # in-process ranks' threads may get here at once
                if cls._instance is None:
                    cls._instance = cls()
        return cls._instance

    def view(self, name: str, t: Any) -> _core.TensorView:
        """torch.Tensor -> TensorView (TypeError naming the argument otherwise)."""
        if not isinstance(t, self.torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.is_cuda:  # fast path: the view straight from the tensor's fields, no DLPack
            dt = self.view_dtypes.get(t.dtype)
            if dt is not None and t.dim() <= 4:
                return _core.TensorView(t.data_ptr(), dt, t.shape, t.stride(), t.device.index)
        if t.requires_grad:
            t = t.detach()
        if t.dtype == self.fp8 and not self.fp8_dlpack:
            t = t.view(self.torch.uint8)
        return _core.TensorView.from_dlpack(self.to_dlpack(t), name)

    def opt_view(self, name: str, t: Any) -> Optional[_core.TensorView]:
        return None if t is None else self.view(name, t)

    def rows(self, name: str, t: Any) -> _core.TensorView:
        """A dispatch's x -> TensorView: a dtype the core has no name for (float16,
        float8_e5m2, int8, ...) goes as its rows' bytes (uint8, [T, H * size]), as
        DeepEP moves rows of any dtype; ``restore`` views the received rows back."""
        torch = self.torch
        if isinstance(t, torch.Tensor) and t.dtype not in self.view_dtypes and t.dim() == 2:
            try:
                t = t.view(torch.uint8)
            except RuntimeError as e:
                raise ValueError(f"{name}: rows of {t.dtype} must be contiguous to be sent "
                                 f"as bytes ({e})") from None
        return self.view(name, t)

    def restore(self, recv: Any, like: Any) -> Any:
        """Received rows in ``like``'s dtype (see ``rows``)."""
        torch = self.torch
        if recv is None or not isinstance(like, torch.Tensor) or recv.dtype == like.dtype:
            return recv
        return recv.view(torch.uint8).view(like.dtype)

    def out(self, obj: Any) -> Any:
        """A result of the core -> torch.Tensor (see to_py in python/src/core.cpp)."""
        torch = self.torch
        if obj is None:
            return None
        if isinstance(obj, tuple):  # part of an allocated tensor
            base, shape, strides, offset = obj
            obj = base.as_strided(shape, strides, base.storage_offset() + offset)
        elif not isinstance(obj, torch.Tensor):  # memory EPX owns
            obj = torch.from_dlpack(obj)
        if obj.dtype == torch.uint8:  # EPX makes no uint8 tensors: these are float8 bits
            obj = obj.view(self.fp8)
        return obj

    def allocator(self, device: "torch.device") -> Callable:
        """alloc(dtype, shape, stream): torch.empty from the caching allocator on `stream`.

        Returns (tensor, its data pointer): the core trusts a contiguous tensor of the
        requested dtype and shape at that address, which skips a DLPack export per
        output. Entering a stream context costs more than the allocation itself, so it
        is done only when `stream` is not already the current one.
        """
        torch, dtypes = self.torch, self.alloc_dtypes
        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        streams = {0: torch.cuda.default_stream(index)}
        current_raw, empty = self.raw_stream, torch.empty

        def alloc(dtype: int, shape: Tuple[int, ...], stream: int):
            if current_raw(index) == stream:
                t = empty(shape, dtype=dtypes[dtype], device=device)
            else:
                s = streams.get(stream)
                if s is None:
                    s = streams[stream] = torch.cuda.ExternalStream(stream, device=device)
                with torch.cuda.stream(s):
                    t = empty(shape, dtype=dtypes[dtype], device=device)
            return t, t.data_ptr()

        return alloc
