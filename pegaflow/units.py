"""Units in words, for logs and errors."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """``n`` bytes in GiB (one decimal) from 1 GiB up, else in MiB."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
