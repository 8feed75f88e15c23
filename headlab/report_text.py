"""Small text parsing and formatting shared by the CLI, the scripts and the reports."""

import re

from headlab.errors import HeadlabError

_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BYTE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


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


def parse_bytes(text: str, name: str) -> int:
    """A size as transformers' max_shard_size writes it: '5GB' -> 5 * 10^9, '512MiB' -> 512 * 2^20, '1000' -> 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _BYTE_UNITS:
        raise HeadlabError(f"--{name}: cannot read {text!r}; give a size such as 5GB or 512MiB")
    size = int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    if size < 1:
        raise HeadlabError(f"--{name} must be at least 1 byte")
    return size
