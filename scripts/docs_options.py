"""Rewrite the "## Options" table of every docs/commands/<command>.md from the click definitions.

    python scripts/docs_options.py            # rewrite the tables in place
    python scripts/docs_options.py --check    # exit 1 and name the pages whose table is out of date

The table is the one directly under the page's "## Options" heading (up to the next blank line); the rest of the
page is left as written. Positional arguments are described in the page's prose, not in the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click

PAGES = Path(__file__).resolve().parents[1] / "docs" / "commands"
HEADING = "## Options\n\n"


def options_table(name: str) -> str:
    """The Markdown table of one command's options: the option as `--help` shows it, and its help text."""
    from headlab.cli import cli

    root = click.Context(cli, info_name="headlab")
    command = cli.get_command(root, name)
    context = click.Context(command, info_name=name, parent=root)
    rows = ["| option | meaning |", "|---|---|"]
    for param in command.get_params(context):
        if not isinstance(param, click.Option):
            continue
        record = param.get_help_record(context)
        if record is None or "--help" in param.opts:
            continue
        option, text = (part.replace("|", "\\|") for part in record)
        rows.append(f"| `{option}` | {' '.join(text.split())} |")
    return "\n".join(rows) + "\n"


def with_table(page: str, table: str) -> str:
    """The page with the table under its "## Options" heading replaced (or appended when the page has none)."""
    start = page.find(HEADING)
    if start < 0:
        return page.rstrip("\n") + "\n\n" + HEADING + table
    body = start + len(HEADING)
    end = page.find("\n\n", body)
    end = len(page) if end < 0 else end + 1
    return page[:body] + table + page[end:]


def pages() -> dict[str, Path]:
    """docs/commands/<command>.md for every command of the CLI that has a page."""
    from headlab.cli import cli

    names = cli.list_commands(click.Context(cli))
    return {name: PAGES / f"{name}.md" for name in names if (PAGES / f"{name}.md").exists()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report out-of-date pages instead of rewriting them")
    args = parser.parse_args(argv)
    stale = []
    for name, path in pages().items():
        page = path.read_text()
        updated = with_table(page, options_table(name))
        if updated != page:
            stale.append(str(path))
            if not args.check:
                path.write_text(updated)
    if stale:
        verb = "out of date" if args.check else "rewritten"
        print(f"{verb}: {', '.join(stale)}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
