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
import re
import signal
import sys
from pathlib import Path

import click

from headlab import __version__
from headlab.core.errors import HeadlabError

SHARED_MODULES = ("options", "parsing")  # helpers of every command, not commands


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs, so `headlab --help` stays fast."""

    def _modules(self) -> list[str]:
        return sorted(
            info.name
            for info in pkgutil.iter_modules(__path__)
            if not info.name.startswith("_") and info.name not in SHARED_MODULES
        )

    def list_commands(self, ctx):
        return sorted(name.replace("_", "-") for name in self._modules())

    def get_command(self, ctx, name):
        module_name = name.replace("-", "_")
        if module_name not in self._modules():
            return None
        command = importlib.import_module(f"{__name__}.{module_name}").command
        # start-up: imported with the command it wraps, so that `headlab --help` imports no module of this package
        from headlab.cli._ranks import rank_private_out

        return rank_private_out(command, name)  # under torchrun only rank 0 writes the user's --out

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HeadlabError as error:
            # The command's context is gone once the error leaves click: note its options for main() while the
            # group's context (ctx.invoked_subcommand) is still current.
            error.cli_options = running_options()
            raise

    def format_commands(self, ctx, formatter):
        """The command list of `headlab --help`, from each command function's docstring read as source text: importing
        every command would import torch and transformers, seconds before the list appears."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, click.Command(name, help=_docstring(name)).get_short_help_str(limit)) for name in names]
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


# ---- library messages in the running command's terms ---------------------------------------------------------
#
# Library errors name Python parameters (seq_len=4, unit='kv-group', give kv_heads, pass overwrite=True); the CLI
# shows them as the options of the command that runs (--seq-len 4, --unit 'kv-group', give --kv-heads, pass
# --overwrite).

# Library parameters that a command takes under another name: library name -> the command's parameter, used only
# where the command has no parameter of the library's name (the recovery options of prune and convert-* become
# RecoverySpec / UptrainConfig fields; check_table_origin's allow_foreign; lm-eval's max_length is eval's seq_len).
LIBRARY_NAMES = {
    "allow_foreign": "allow_foreign_scores",
    "stages": "recover_stages",
    "steps": "recover_steps",
    "minutes": "recover_minutes",
    "lr": "recover_lr",
    "objective": "recover_objective",
    "parallel": "recover_parallel",
    "generated": "recover_generated",
    "generated_start": "recover_generated_start",
    "max_length": "seq_len",
    "groupings": "grouping",  # gqa-sweep's comma lists
    "pools": "pool",
    "methods": "method",
}


def _option(param: click.Option, name: str) -> str:
    """How `param` is typed for the library parameter `name`: the option spelled like `name` where the parameter has
    several (--max-length/--seq-len), else its first long one; a boolean flag with an off switch as ON/OFF."""
    spelled = "--" + name.replace("_", "-")
    longs = [opt for opt in param.opts if opt.startswith("--")] or param.opts
    option = spelled if spelled in param.opts else longs[0]
    if param.is_flag and param.secondary_opts:
        return f"{option}/{param.secondary_opts[0]}"
    return option


def command_options(command: click.Command | None) -> dict[str, str]:
    """Parameter name -> option for every option of `command` (see _option), plus the LIBRARY_NAMES it takes under
    another name. Arguments have no option: their names stay as they are."""
    if command is None:
        return {}
    params = {p.name: p for p in command.params if isinstance(p, click.Option) and p.opts and p.name}
    options = {name: _option(param, name) for name, param in params.items()}
    for library, name in LIBRARY_NAMES.items():
        if library not in options and name in params:
            options[library] = _option(params[name], library)
    return options


def running_options() -> dict[str, str]:
    """command_options of the subcommand that runs, found from the current click context (empty outside one)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return {}
    command = ctx.command
    if isinstance(command, click.Group) and ctx.invoked_subcommand:  # headlab COMMAND: one level of commands
        command = command.get_command(ctx, ctx.invoked_subcommand)
    return command_options(command)


_NO_VALUE = set(" \t,;)]") | {""}


def cli_message(message: str, options: dict[str, str]) -> str:
    """`message` (a library error naming Python parameters) with each parameter in `options` (name -> option, a
    boolean flag as ON/OFF) written as the option: NAME=VALUE -> OPTION VALUE; NAME= with no value after it, and
    NAME=True -> OPTION (ON of ON/OFF); NAME=False -> OFF (left as it is for a flag without one); a bare NAME ->
    OPTION only for names with an underscore (a plain word such as `method` or `data` may be prose). Names are whole
    words outside paths, attributes and quotes (text.seq_len, /runs/seq_len, 'seq_len' stay); one pass, so an
    option is never translated again."""
    if not options:
        return message
    names = "|".join(re.escape(name) for name in sorted(options, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./'\"-])({names})(?:=(True|False)(?!\w)|(=))?")

    def replace(match: re.Match) -> str:
        name, flag, equals = match.group(1), match.group(2), match.group(3)
        on, _, off = options[name].partition("/")
        after = match.string[match.end() : match.end() + 1]
        if flag == "True":
            return on
        if flag == "False":
            return off or match.group(0)
        if equals:
            return on if after in _NO_VALUE else f"{on} "
        if "_" in name and not re.match(r"[\w'\"(./=-]", after):
            return options[name]
        return match.group(0)

    return pattern.sub(replace, message)


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
        click.echo(f"headlab: error: {cli_message(str(error), getattr(error, 'cli_options', {}))}", err=True)
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
