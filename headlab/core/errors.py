"""The one error type for user mistakes.

The CLI prints a HeadlabError as a single line and exits with code 2; any other exception is a bug and keeps
its traceback.
"""

import functools
import importlib
import warnings


class HeadlabError(Exception):
    """Bad input from the user (path, option, model, corpus): reported as one line, exit code 2."""


def moved_names(module: str, moved: dict[str, str]):
    """A module `__getattr__` (PEP 562) for names another module now owns: each still resolves from `module`, with a
    DeprecationWarning naming the new home, for one release (issue 13 gave many functions new homes)."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to {moved[name]}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__


def renamed_keywords(**old_to_new: str):
    """Accept a keyword's earlier name for one release: `@renamed_keywords(part="split")` maps part= onto split=
    with a DeprecationWarning (issue 13 gave one name to one thing: split, data, calibration_tokens)."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{function.__name__}() got both {old}= and its new name {new}=")
                    warnings.warn(
                        f"{function.__name__}({old}=...) is now {function.__name__}({new}=...)",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper

    return decorate
