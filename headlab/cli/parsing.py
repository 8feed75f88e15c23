"""Option values the click types cannot read alone: comma-separated lists and sizes such as 5GB."""

import re

from headlab.core.errors import HeadlabError

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


def token_count(text: str) -> int:
    """A length in tokens: '2048' or '2k' (k = 1024 tokens) -> 2048; for parse_list."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def parse_tokens(text: str | None, name: str) -> int | None:
    """One length in tokens for option --name ('8192' or '8k'; None stays None); unreadable or below 1 is an error."""
    if text is None:
        return None
    try:
        tokens = token_count(text)
    except ValueError:
        raise HeadlabError(f"--{name}: cannot read {text!r}; give a number of tokens such as 8192 or 8k") from None
    if tokens < 1:
        raise HeadlabError(f"--{name} must be at least 1 token, got {text!r}")
    return tokens


def parse_bytes(text: str, name: str) -> int:
    """A size as transformers' max_shard_size writes it: '5GB' -> 5 * 10^9, '512MiB' -> 512 * 2^20, '1000' -> 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _BYTE_UNITS:
        raise HeadlabError(f"--{name}: cannot read {text!r}; give a size such as 5GB or 512MiB")
    size = int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    if size < 1:
        raise HeadlabError(f"--{name} must be at least 1 byte")
    return size
