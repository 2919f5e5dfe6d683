"""Numbers for people: bytes in binary units, times in milliseconds, plurals."""
from __future__ import annotations

GIB = 2**30


def human(n: float) -> str:
    """Bytes in binary units: `1.50 GiB`, `3.0 MiB`, `64.0 KiB`, `128 B`."""
    n = int(n)
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def signed(n: int) -> str:
    """A byte delta: `+3.0 MiB`, `-64.0 KiB`, `0`."""
    return ("+" if n > 0 else "-") + human(abs(n)) if n else "0"


def ms(us: float) -> str:
    """Microseconds as milliseconds: `4.80 ms`; three decimals below 1 ms (`0.150 ms`)."""
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us / 1e3:.3f} ms"


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 layer`, `2 layers`, `1,024 tensors`."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def percent(part: float, whole: float) -> str:
    """`part` as a percentage of `whole`, to the unit (`0%` and `100%` only when exact)."""
    if not whole:
        return "0%"
    p = 100 * part / whole
    if 0 < p < 1:
        return "<1%"
    if 99 < p < 100:
        return ">99%"
    return f"{p:.0f}%"
