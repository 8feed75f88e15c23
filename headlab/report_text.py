"""Small text parsing and formatting shared by the CLI, the scripts and the reports."""

from headlab.errors import HeadlabError


def parse_list(text: str, cast, name: str, allowed=None) -> list:
    """`"a,b,c"` -> [cast(a), cast(b), cast(c)]; an empty list, an unreadable value or one outside `allowed` is an
    error naming the option --name."""
    try:
        values = [cast(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HeadlabError(f"--{name}: cannot read {text!r}; give comma-separated values") from None
    if not values:
        raise HeadlabError(f"--{name} is empty")
    unknown = [v for v in values if allowed is not None and v not in allowed]
    if unknown:
        raise HeadlabError(f"--{name}: unknown {unknown}; use some of {', '.join(map(str, allowed))}")
    return values


def human_bytes(n: float) -> str:
    """Bytes in binary units: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
