"""Units: bytes inside, binary units (GiB = 1024^3 B, labelled) only where a person reads them."""

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def gib(n: float) -> str:
    """`n` bytes as people read them: '12.34 GiB'."""
    return f"{n / GiB:.2f} GiB"
