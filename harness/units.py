"""Units: bytes inside, binary units (GiB = 1024^3 B, labelled) only where a person reads them."""

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def gib(n: float) -> str:
    """`n` bytes as people read them: '12.34 GiB'."""
    return f"{n / GiB:.2f} GiB"


def gib_or_mib(n: float) -> str:
    """`n` bytes as `gib` says them, or in MiB below a tenth of a GiB ('4.06 MiB': a decode step's
    traffic, which GiB would round to nothing)."""
    return gib(n) if n >= GiB / 10 else f"{n / MiB:.2f} MiB"
