"""Output files written all or nothing: atomic directories and files, the existing-output check, JSON output.

Every command's results go through here, so a crash or an interrupt never leaves a half-written run behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from headlab.errors import HeadlabError


def check_out(out: Path | None, overwrite: bool) -> None:
    """Fail before any work when the output directory exists and --overwrite was not given."""
    if out is not None and Path(out).exists() and not overwrite:
        raise HeadlabError(f"{out} already exists; pass --overwrite to replace it")


@contextlib.contextmanager
def atomic_directory(target: Path, overwrite: bool = False):
    """Yield a temporary directory beside `target` and rename it into place only if the block succeeds.

    An existing target is replaced only with overwrite=True (and only after the new content is complete).
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise HeadlabError(f"{target} already exists; pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it and a rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_text(payload) -> str:
    """The one JSON layout of every file headlab writes: indented, non-JSON values as str, a final newline."""
    return json.dumps(payload, indent=2, default=str) + "\n"


def write_json(path: Path, payload: dict) -> None:
    """Write `payload` as JSON (see json_text) into a file that is itself inside an atomic directory or new."""
    Path(path).write_text(json_text(payload))
