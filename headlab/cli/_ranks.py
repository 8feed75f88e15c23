"""Under torchrun, only rank 0 writes the output a user names.

Every rank runs the whole command: its evaluations, statistics, importance passes and recovery all-reduce across
the ranks, so none may stop early. A rank other than 0 therefore writes its copy of the output into a folder of its
own under the temporary directory ($TMPDIR), removed when the process exits. No two processes ever publish the same
path, and everything a command reads back from its own output (a checkpoint's reload check, a report's tables) is
there on every rank.
"""

from __future__ import annotations

import atexit
import copy
import functools
import os
import shutil
import tempfile
from pathlib import Path

import click

# Commands whose --out is optional and writes nothing when omitted (eval without --tasks, speed's printed table).
# Every other command with --out writes a default path when it is omitted, so the other ranks get a private one.
OUTPUT_ONLY_WHEN_ASKED = frozenset({"eval", "speed"})


def launch_rank() -> int:
    """This process's rank as torchrun set it (RANK), readable before any process group exists; 0 without one."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def rank_private_out(command: click.Command, name: str) -> click.Command:
    """`command` itself on rank 0 (and outside torchrun); on another rank a copy whose --out is a scratch folder of
    this process, named like the user's output (or the command), removed at exit."""
    rank = launch_rank()
    if rank == 0 or not any(param.name == "out" for param in command.params):
        return command
    scratch = Path(tempfile.mkdtemp(prefix=f"headlab-rank{rank}-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    callback = command.callback

    @functools.wraps(callback)
    def private(*args, out=None, **kwargs):
        if out is not None or name not in OUTPUT_ONLY_WHEN_ASKED:
            out = scratch / (Path(out).name if out is not None else name)
        return callback(*args, out=out, **kwargs)

    private_command = copy.copy(command)
    private_command.callback = private
    return private_command
