"""The `headlab` command: a click group whose commands live one per module in this package.

Each module defines `command` (a click command, a thin wrapper over one public function); they are found here by
name, so adding a capability means adding a module. User errors (HeadlabError, click usage errors) print one
line and exit with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import signal
import sys
from pathlib import Path

import click

from headlab import __version__
from headlab.core.errors import HeadlabError


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs, so `headlab --help` stays fast."""

    def _modules(self) -> list[str]:
        return sorted(
            info.name
            for info in pkgutil.iter_modules(__path__)
            if not info.name.startswith("_") and info.name != "options"
        )

    def list_commands(self, ctx):
        return sorted(name.replace("_", "-") for name in self._modules())

    def get_command(self, ctx, name):
        module_name = name.replace("-", "_")
        if module_name not in self._modules():
            return None
        return importlib.import_module(f"{__name__}.{module_name}").command

    def format_commands(self, ctx, formatter):
        """The command list of `headlab --help`, from each command function's docstring read as source text: importing
        every command would import torch and transformers, seconds before the list appears."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, click.utils.make_default_short_help(_docstring(name), limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _docstring(name: str) -> str:
    """The docstring of `command` in the command's module, read without importing it (what click shows as help)."""
    source = Path(__file__).with_name(f"{name.replace('-', '_')}.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "command":
            return inspect.cleandoc(ast.get_docstring(node) or "")
    return ""


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="headlab")
def cli():
    """Per-head attention analysis, head importance, pruning and GQA conversion for transformers models.

    Every command runs on the embedded SmolLM2-135M model and the embedded Python-reference corpus when --model
    and --data are omitted.
    """


def _raise_on_sigterm(signum, frame):
    # Turn SIGTERM into an exception so atomic writes clean up their temporary directories, as with Ctrl-C.
    raise KeyboardInterrupt(f"signal {signum}")


def _quiet_other_ranks() -> None:
    """Under torchrun only rank 0 prints results and progress; the others keep stderr for errors."""
    if int(os.environ.get("RANK", "0")) != 0:
        os.environ["TQDM_DISABLE"] = "1"
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if hasattr(signal, "SIGHUP"):  # a closed terminal: clean up like SIGTERM instead of dying mid-write
        signal.signal(signal.SIGHUP, _raise_on_sigterm)
    _quiet_other_ranks()
    try:
        cli.main(args=argv, prog_name="headlab", standalone_mode=False)
    except HeadlabError as error:
        click.echo(f"headlab: error: {error}", err=True)
        sys.exit(2)
    except click.UsageError as error:
        command = error.ctx.command_path if error.ctx else "headlab"
        click.echo(f"{command}: error: {error.format_message()} (see --help)", err=True)
        sys.exit(2)
    except click.ClickException as error:
        click.echo(f"headlab: error: {error.format_message()}", err=True)
        sys.exit(error.exit_code if error.exit_code != 1 else 2)
    except click.Abort:
        click.echo("headlab: interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("headlab: interrupted", err=True)
        sys.exit(130)
    sys.exit(0)
