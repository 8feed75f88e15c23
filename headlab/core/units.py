"""Sizes as people read them: bytes in binary units."""


def human_bytes(n: float) -> str:
    """Bytes in binary units: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
