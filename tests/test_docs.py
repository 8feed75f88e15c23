"""The documentation stays true to the repository: relative links and anchors resolve, the README's set-up block
keeps the two commands .ci/run reads, every command has a page whose options table matches the CLI, and every
option used in a documented `headlab` example exists."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import click
import pytest

from headlab.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
# Pages other branches write (issues 13, 14, 15, 16, 18, 19, 20); linked from here before they are merged.
OTHER_BRANCH_PAGES = {
    DOCS / name
    for name in (
        "design.md",
        "evaluation.md",
        "recovery.md",
        "selection.md",
        "runtimes.md",
        "performance.md",
        "reliability.md",
        "commands/export-gguf.md",
        "commands/speed.md",
    )
}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(path: Path):
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        yield target, (path.parent / file_part).resolve() if file_part else path, anchor


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        for target, resolved, anchor in relative_links(page):
            if resolved in OTHER_BRANCH_PAGES and not resolved.exists():
                continue
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_pages_written_on_other_branches_exist():
    """Fails until the branches that write these pages are merged: then every link to them resolves."""
    linked = {resolved for page in PAGES for _, resolved, _ in relative_links(page)}
    missing = sorted(str(p.relative_to(ROOT)) for p in OTHER_BRANCH_PAGES & linked if not p.exists())
    assert not missing, f"linked but not written yet: {', '.join(missing)}"


def test_every_docs_page_is_reachable_from_the_index():
    reachable = {DOCS / "index.md"}
    frontier = [DOCS / "index.md", ROOT / "README.md"]
    while frontier:
        page = frontier.pop()
        for _, resolved, _ in relative_links(page):
            if resolved.suffix == ".md" and resolved.is_relative_to(DOCS) and resolved.exists():
                if resolved not in reachable:
                    reachable.add(resolved)
                    frontier.append(resolved)
    orphans = sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p not in reachable)
    assert not orphans, f"not linked from docs/index.md or the pages it links: {', '.join(orphans)}"


def first_bash_block(text: str) -> list[str]:
    block = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S)
    assert block, "README.md has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_starts_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    commands = first_bash_block(text)
    assert len(commands) == 2, commands
    assert commands[0].rstrip().endswith("headlab demo")
    assert "pytest" in commands[1] and "pytest" not in commands[0]
    # The block comes right after the title: nothing a newcomer must scroll past.
    assert text.index("```bash") < text.index("\n## ")


@pytest.mark.skipif(shutil.which("awk") is None, reason="needs awk, as .ci/run does")
def test_ci_reads_the_readme_test_command():
    """Run .ci/run's own awk program on the README: it must find the second set-up command."""
    program = re.search(r"awk '([^']*)' README\.md", (ROOT / ".ci" / "run").read_text())
    assert program, ".ci/run no longer reads README.md with awk"
    found = subprocess.run(["awk", program.group(1), "README.md"], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout.strip() == first_bash_block((ROOT / "README.md").read_text())[1].strip()


def command_names() -> list[str]:
    return cli.list_commands(click.Context(cli))


def options_of(name: str) -> set[str]:
    command = cli.get_command(click.Context(cli), name)
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("-")}


def test_every_command_has_a_page_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in command_names():
        assert (DOCS / "commands" / f"{name}.md").exists(), f"docs/commands/{name}.md is missing"
        assert f"(docs/commands/{name}.md)" in readme, f"README.md does not link docs/commands/{name}.md"


def load_docs_options():
    spec = importlib.util.spec_from_file_location("docs_options", ROOT / "scripts" / "docs_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_tables_match_the_cli():
    """Regenerate with `python scripts/docs_options.py` after adding or changing an option."""
    docs_options = load_docs_options()
    stale = [
        name
        for name, path in docs_options.pages().items()
        if docs_options.with_table(path.read_text(), docs_options.options_table(name)) != path.read_text()
    ]
    assert not stale, f"options tables out of date (run python scripts/docs_options.py): {', '.join(stale)}"


def test_with_table_replaces_only_the_options_table():
    docs_options = load_docs_options()
    page = "# x\n\ntext\n\n## Options\n\n| option | meaning |\n|---|---|\n| `--old` | gone |\n\nAfter.\n"
    table = "| option | meaning |\n|---|---|\n| `--new` | new |\n"
    assert docs_options.with_table(page, table) == (
        "# x\n\ntext\n\n## Options\n\n| option | meaning |\n|---|---|\n| `--new` | new |\n\nAfter.\n"
    )
    assert docs_options.with_table("# y\n", table) == "# y\n\n## Options\n\n" + table


def documented_invocations():
    """Every `headlab COMMAND ...` (or `torchrun ... -m headlab COMMAND ...`) in a bash block of the README and docs/."""
    for page in PAGES:
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                tokens = list(lexer)
                commands, current = [], []
                for token in tokens:  # split at shell operators (&&, ||, |, ;) outside quotes
                    if token and set(token) <= set("&|;"):
                        commands.append(current)
                        current = []
                    else:
                        current.append(token)
                for words in [*commands, current]:
                    if words[:1] == ["torchrun"] and "-m" in words:
                        words = words[words.index("-m") + 1 :]
                    if words[:1] == ["headlab"] and len(words) > 1:
                        yield page, words[1:]
        for code in INLINE_CODE.findall(FENCE.sub("", page.read_text())):
            words = code.strip("`").replace("...", "").split()
            # `headlab COMMAND --help`-style placeholders are upper case
            if words[:1] == ["headlab"] and len(words) > 1 and not words[1].isupper():
                yield page, words[1:]


def test_documented_examples_use_existing_commands_and_options():
    names = set(command_names())
    wrong, shown = [], set()
    for page, words in documented_invocations():
        name, args = words[0], words[1:]
        if name in ("--version", "--help", "-h"):  # options of `headlab` itself
            continue
        shown.add(name)
        if name not in names:
            if (DOCS / "commands" / f"{name}.md") not in OTHER_BRANCH_PAGES:
                wrong.append(f"{page.relative_to(ROOT)}: unknown command {name!r}")
            continue
        for word in args:
            option = word.split("=")[0]
            if option.startswith("-") and option not in options_of(name):
                wrong.append(f"{page.relative_to(ROOT)}: headlab {name} has no option {option}")
    assert not wrong, "\n".join(wrong)
    assert names <= shown, f"commands without an example: {', '.join(sorted(names - shown))}"


def test_api_reference_names_exist():
    """Every function docs/api.md lists under a `headlab.X` heading is importable from headlab.X."""
    import importlib

    missing, module = [], None
    for line in (DOCS / "api.md").read_text().splitlines():
        heading = re.match(r"### `(headlab(?:\.\w+)*)`", line)
        if heading:
            module = importlib.import_module(heading.group(1))
            continue
        if module is None or not line.startswith("| `"):
            continue
        # The names before the cell's description ("`f(x)`, `g(y)`: what they do"); `obj.method(...)` is skipped.
        names = re.split(r"(?<!\\)\|", line)[1].split("`:")[0]
        for name in re.findall(r"`(\w+)[(`]", names):
            if not hasattr(module, name):
                missing.append(f"{module.__name__}.{name}")
    assert module is not None, "docs/api.md has no `headlab.X` sections"
    assert not missing, f"docs/api.md lists names that do not exist: {', '.join(missing)}"


def test_dotted_names_in_the_docs_exist():
    """Every `headlab.module.name` the README and docs/ mention (in code spans and blocks) can be imported."""
    import importlib

    missing = set()
    for page in PAGES:
        for dotted in set(re.findall(r"\bheadlab(?:\.[A-Za-z_]\w*)+", page.read_text())):
            parts = dotted.split(".")
            if parts[-1] in ("py", "json", "md"):  # file names such as headlab.json
                continue
            for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
                try:
                    target = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    target = getattr(target, attribute, None)
                if target is None:
                    missing.add(f"{page.relative_to(ROOT)}: {dotted}")
                break
    assert not missing, "\n".join(sorted(missing))
