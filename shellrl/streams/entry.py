"""Stream entries as read (`StreamEntry`) and as written (`OutgoingEntry`), and entry-id helpers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _next_id(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


@dataclass(frozen=True)
class StreamEntry:
    """One delivered entry. `deliveries`: how often the group delivered it (1 = first time)."""

    stream: str
    entry_id: str
    fields: dict[str, bytes] = field(repr=False)
    deliveries: int = 1

    @property
    def pb(self) -> bytes:
        return self.fields.get("pb", b"")

    def text(self, name: str, default: str = "") -> str:
        value = self.fields.get(name)
        return default if value is None else _s(value)


@dataclass(frozen=True)
class OutgoingEntry:
    """One entry to append: `pb` (serialized protobuf), an optional idempotency key, routing fields."""

    pb: bytes
    idempotency_key: str | None = None
    fields: Mapping[str, str | int | bytes] = field(default_factory=dict)


def _flat_fields(e: OutgoingEntry) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {"pb": e.pb}
    for name, value in e.fields.items():
        out[name] = value if isinstance(value, bytes) else str(value)
    return out


def _fields(raw: dict) -> dict[str, bytes]:
    return {_s(k): v for k, v in raw.items()}
