"""Kernel configuration (DeepEP's deep_ep.Config)."""

from __future__ import annotations

from . import _core
from . import compat as _compat
from .utils import SIZE, _int


class Config:
    """Tuning knobs of the high-throughput dispatch and combine.

    Takes DeepEP's arguments. The NVLink chunk sizes map onto EPX's
    ``epx::Config``: ``num_max_nvl_chunked_send_tokens`` is the number of tokens a
    sender moves between two progress signals (``num_max_send_tokens``) and
    ``num_max_nvl_chunked_recv_tokens`` the rows of the receive ring per peer
    rank (``num_max_recv_tokens``; calls may send more tokens: the ring laps).
    The RDMA values are the rings' across nodes (they carry the calls whose whole-call
    areas do not fit num_nvl_bytes, or every call with ``EPX_HT_RINGS``): records per
    network put and per network ring (docs/internode_ht.md). The whole-call kernels
    size their network areas per call and do not read them, so values other than
    DeepEP's defaults warn once.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self._cfg = _core.Config(_int("num_sms", num_sms),
                                 _int("num_max_nvl_chunked_send_tokens",
                                      num_max_nvl_chunked_send_tokens),
                                 _int("num_max_nvl_chunked_recv_tokens",
                                      num_max_nvl_chunked_recv_tokens))
        self._rdma = {}
        for name, value in (("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            self._set_rdma(name, value)
            _compat.ignored_unless_default("Config", name, self._rdma[name], self._RDMA[name][1],
                                           "used only by the rings across nodes (calls "
                                           "whose whole-call areas do not fit num_nvl_bytes, "
                                           "or EPX_HT_RINGS); the whole-call kernels size "
                                           "their network areas per call")

    @classmethod
    def _wrap(cls, cfg: _core.Config) -> "Config":
        self = cls.__new__(cls)
        self._cfg = cfg
        self._rdma = {name: getattr(cfg, field) or default
                      for name, (field, default) in cls._RDMA.items()}
        return self

    @property
    def num_sms(self) -> int:
        """SMs (thread blocks) the kernel occupies: a third send, the rest receive."""
        return self._cfg.num_sms

    @num_sms.setter
    def num_sms(self, value: int) -> None:
        self._cfg.num_sms = _int("num_sms", value)

    @property
    def num_max_nvl_chunked_send_tokens(self) -> int:
        return self._cfg.num_max_send_tokens

    @num_max_nvl_chunked_send_tokens.setter
    def num_max_nvl_chunked_send_tokens(self, value: int) -> None:
        self._cfg.num_max_send_tokens = _int("num_max_nvl_chunked_send_tokens", value)

    @property
    def num_max_nvl_chunked_recv_tokens(self) -> int:
        return self._cfg.num_max_recv_tokens

    @num_max_nvl_chunked_recv_tokens.setter
    def num_max_nvl_chunked_recv_tokens(self, value: int) -> None:
        self._cfg.num_max_recv_tokens = _int("num_max_nvl_chunked_recv_tokens", value)

    # The RDMA fields as given; the C++ config holds 0 (EPX's own ring sizes, which
    # suit its one-host engines and NICs alike, docs/internode_ht.md) for DeepEP's
    # defaults, and the value otherwise.
    _RDMA = {"num_max_rdma_chunked_send_tokens": ("num_max_rdma_send_tokens", 6),
             "num_max_rdma_chunked_recv_tokens": ("num_max_rdma_recv_tokens", 256)}

    def _set_rdma(self, name: str, value: int) -> None:
        field, deep_ep_default = self._RDMA[name]
        v = _int(name, value, (0, 1 << 20))
        setattr(self._cfg, field, 0 if v == deep_ep_default else v)
        self._rdma[name] = v

    @property
    def num_max_rdma_chunked_send_tokens(self) -> int:
        """Records per network put of the rings across nodes."""
        return self._rdma["num_max_rdma_chunked_send_tokens"]

    @num_max_rdma_chunked_send_tokens.setter
    def num_max_rdma_chunked_send_tokens(self, value: int) -> None:
        self._set_rdma("num_max_rdma_chunked_send_tokens", value)

    @property
    def num_max_rdma_chunked_recv_tokens(self) -> int:
        """Records per network ring of the rings across nodes."""
        return self._rdma["num_max_rdma_chunked_recv_tokens"]

    @num_max_rdma_chunked_recv_tokens.setter
    def num_max_rdma_chunked_recv_tokens(self, value: int) -> None:
        self._set_rdma("num_max_rdma_chunked_recv_tokens", value)

    @property
    def pull_dispatch(self) -> bool:
        """EPX only: receivers read each token from its sender's buffer (docs/design.md)."""
        return self._cfg.pull_dispatch

    @pull_dispatch.setter
    def pull_dispatch(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"pull_dispatch: expected a bool, got {type(value).__name__}")
        self._cfg.pull_dispatch = value

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int,
                                 num_topk: int = 16) -> int:
        """Bytes of NVLink buffer (``num_nvl_bytes``) a rank needs for tokens of
        ``hidden_bytes`` (hidden x element size) among ``num_ranks`` ranks. More than
        8 ranks are nodes of 8: the internode ops' worst case for 4096 tokens per rank
        (``Buffer.get_internode_nvl_size_hint`` sizes for other counts)."""
        return self._cfg.get_nvl_buffer_size_hint(_int("hidden_bytes", hidden_bytes, SIZE),
                                                  _int("num_ranks", num_ranks),
                                                  _int("num_topk", num_topk))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer (``num_rdma_bytes``) the high-throughput kernels need (0)."""
        return self._cfg.get_rdma_buffer_size_hint(_int("hidden_bytes", hidden_bytes, SIZE),
                                                   _int("num_ranks", num_ranks))

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens})")


def _core_config(config) -> "_core.Config | None":
    if config is None:
        return None
    if isinstance(config, Config):
        return config._cfg
    if isinstance(config, _core.Config):
        return config
    raise TypeError(f"config: expected an epx.Config or None, got {type(config).__name__}")
