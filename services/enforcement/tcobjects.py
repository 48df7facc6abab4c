"""The traffic-control objects both backends of the tc enforcer read and write.

:class:`~services.enforcement.tc.TcEnforcer` decides what the kernel must hold
(:mod:`services.enforcement.tc`'s docstring) and hands the work to a backend,
:class:`TcBackend`: ``tc`` processes (:class:`~services.enforcement.tc.ProcessTc`) or an
rtnetlink socket (:class:`~services.enforcement.tcnetlink.NetlinkTc`). What they share
is here, below both: the HTB handles, the classic BPF program that classifies by mark
and carries its ShareID, a class and a filter as read back, and :class:`TcError`. The
netlink backend imports this module and nothing of :mod:`~services.enforcement.tc`;
the enforcer imports the netlink backend (when chosen) — one way, kept by the
``tc-layers`` contract (``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "DEFAULT_MINOR",
    "HTB_MAJOR",
    "MAX_SHARE_ID_BYTES",
    "ClassState",
    "FilterState",
    "TcBackend",
    "TcError",
    "decode_program",
    "encode_program",
]

#: The handle major of dracap's root qdisc (``dca:``) and the minor of its default class.
HTB_MAJOR: Final = 0xDCA
DEFAULT_MINOR: Final = 0xFFFF
MAX_SHARE_ID_BYTES: Final = 240

# Classic BPF opcodes and the ancillary offset of skb->mark (linux/filter.h).
_LD_W_ABS: Final = 0x20
_LD_IMM: Final = 0x00
_ALU_AND_K: Final = 0x54
_JEQ_K: Final = 0x15
_RET_K: Final = 0x06
_SKF_AD_MARK: Final = (-0x1000 + 20) & 0xFFFFFFFF  # SKF_AD_OFF + SKF_AD_MARK
_U32: Final = 0xFFFFFFFF


def encode_program(mark: int, mask: int, share_id: str) -> list[tuple[int, int, int, int]]:
    """The classic BPF filter: match ``skb->mark & mask == mark``, labelled with the id."""
    raw = share_id.encode()
    if not raw or len(raw) > MAX_SHARE_ID_BYTES:
        raise ValueError(f"a ShareID must have 1..{MAX_SHARE_ID_BYTES} bytes")
    padded = raw + b"\0" * (-len(raw) % 4)
    words = [len(raw)] + [
        int.from_bytes(padded[i : i + 4], "big") for i in range(0, len(padded), 4)
    ]
    return [
        (_LD_W_ABS, 0, 0, _SKF_AD_MARK),
        (_ALU_AND_K, 0, 0, mask),
        (_JEQ_K, 0, len(words) + 1, mark),
        (_RET_K, 0, 0, _U32),  # -1: the filter's classid
        *[(_LD_IMM, 0, 0, w) for w in words],  # unreachable: the ShareID label
        (_RET_K, 0, 0, 0),  # no match
    ]


def decode_program(insns: Sequence[tuple[int, int, int, int]]) -> tuple[int, int, str] | None:
    """``(mark, mask, share_id)`` of a program :func:`encode_program` wrote, else None."""
    if len(insns) < 6:
        return None
    head, tail = insns[:4], insns[4:-1]
    if (head[0][0], head[0][3]) != (_LD_W_ABS, _SKF_AD_MARK) or head[1][0] != _ALU_AND_K:
        return None
    if head[2][0] != _JEQ_K or head[2][2] != len(tail) + 1 or head[3] != (_RET_K, 0, 0, _U32):
        return None
    if insns[-1] != (_RET_K, 0, 0, 0) or any(i[0] != _LD_IMM for i in tail):
        return None
    length, words = tail[0][3], [i[3] for i in tail[1:]]
    raw = b"".join(w.to_bytes(4, "big") for w in words)
    if length > len(raw) or len(raw) - length >= 4:
        return None
    try:
        share_id = raw[:length].decode()
    except UnicodeDecodeError:
        return None
    return head[2][3], head[1][3], share_id


@dataclass(frozen=True)
class ClassState:
    """One HTB class as the kernel holds it (rates in bytes per second)."""

    minor: int
    rate: int
    ceil: int
    rate_text: str | None = None  # what tc printed, when it printed text
    bytes: int = 0
    packets: int = 0
    drops: int = 0
    overlimits: int = 0


@dataclass(frozen=True)
class FilterState:
    """One dracap filter: its priority, the class it steers to, its mark and ShareID."""

    pref: int
    minor: int
    mark: int
    mask: int
    share_id: str


class TcError(Exception):
    """A request to the kernel's traffic control failed (a ``tc`` process or a netlink
    request): ``missing`` when the interface does not exist, ``errno`` when known."""

    def __init__(self, what: str, detail: str, *, errno: int = 0, missing: bool = False) -> None:
        super().__init__(f"{what}: {detail.strip()}")
        self.stderr = detail
        self.errno = errno
        self.missing = missing


class TcBackend(Protocol):
    """The kernel work of :class:`~services.enforcement.tc.TcEnforcer`: the same objects,
    whatever the transport.

    Every method raises :class:`TcError`; ``missing`` set when the interface is gone.
    """

    async def root(self, iface: str) -> tuple[str | None, str]:
        """Kind and handle (``"dca:"``) of the root qdisc; ``None``: only the default."""
        ...

    async def replace_root(self, iface: str) -> None: ...

    async def replace_class(
        self, iface: str, minor: int, rate: int, burst: int, quantum: int
    ) -> None: ...

    async def delete_class(self, iface: str, minor: int) -> None: ...

    async def replace_filter(
        self, iface: str, minor: int, program: Sequence[tuple[int, int, int, int]]
    ) -> None: ...

    async def delete_filter(self, iface: str, pref: int) -> None: ...

    async def filters(self, iface: str) -> list[FilterState]: ...

    async def classes(self, iface: str, *, stats: bool = False) -> list[ClassState]: ...

    async def get_class(self, iface: str, minor: int) -> list[ClassState]: ...

    def close(self) -> None: ...
