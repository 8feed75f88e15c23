"""The package's import structure, read from its own folders: every module lives in a domain package (a wing),
wings import only from wings below them, siblings never from each other, there are no circles, and an import inside a
function says why (start-up time).

A new module fails here until it sits in a wing's folder; a new wing fails until it is placed in WINGS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import headlab

PACKAGE = Path(headlab.__file__).parent

# Wings from the top (docs/design.md); wings on one line are siblings and may not import each other. A module may
# import from its own wing or any wing on a lower line.
WINGS = [
    ("cli",),  # click commands: parse options into specs, call one workflow, print
    ("reporting",),  # the end-to-end report and its rendering
    ("kv", "pruning"),  # KV-cache compression; head pruning
    ("recovery", "runtimes"),  # compensation, reconstruction, uptraining; GGUF, llama.cpp, lm-eval, speed
    ("viz",),  # figures from saved tables
    ("measure",),  # statistics, importance, perplexity, costs
    ("mechanisms",),  # hooks, gates, attention capture, restoring, recompute, losses
    ("core",),  # adapters, loading, data, checkpoints, layouts, validation, tables, files, errors
]
# The package's own two files: the version and the error type (headlab), and `python -m headlab` (the CLI's).
TOP_LEVEL = {"headlab": "core", "headlab.__main__": "cli"}

# Words one of which a comment on (or just above) a function-level import must contain.
DEFERRED_REASONS = ("start-up",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    """The wing a module lives in: the first folder under headlab/ (headlab.kv.gqa -> kv); None for a flat module."""
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and any(parts[1] in line for line in WINGS) else None


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The headlab modules an import statement names (`from headlab import gqa` names headlab.kv.gqa)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "headlab"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "headlab":
        return []
    names = [target]
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file() or (
            PACKAGE.parent / sub.replace(".", "/") / "__init__.py"
        ).is_file():
            names.append(sub)
    return names


def package_imports() -> dict[str, list[tuple[str, int, bool, str]]]:
    """module -> [(imported module, line, inside a function, comment text around the statement)]."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        nested = set()
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested.update(id(n) for n in ast.walk(function) if n is not function)
        edges = []
        for node in ast.walk(tree):
            for target in imported_modules(node, module, path.name == "__init__.py"):
                if target == module:
                    continue
                first = node.lineno - 1  # a comment may head a block of imports: look up through the block
                while first > 0 and lines[first - 1].strip().startswith(("from ", "import ", "#")):
                    first -= 1
                around = "\n".join(lines[first : node.end_lineno])
                edges.append((target, node.lineno, id(node) in nested, around))
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_module_lives_in_a_wing_folder():
    unplaced = [module for module in package_imports() if layer_of(module) is None]
    assert not unplaced, f"move these modules into a wing's folder (or place a new wing in WINGS): {unplaced}"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == {wing for line in WINGS for wing in line}


def test_every_wing_declares_its_public_modules():
    """`__all__` in each library wing names its modules (the CLI's public face is its commands, found by name)."""
    for line in WINGS[1:]:
        for wing in line:
            init = PACKAGE / wing / "__init__.py"
            namespace = {}
            exec(
                compile(
                    ast.Module(
                        body=[n for n in ast.parse(init.read_text()).body if isinstance(n, ast.Assign)], type_ignores=[]
                    ),
                    str(init),
                    "exec",
                ),
                namespace,
            )
            modules = {p.stem for p in (PACKAGE / wing).glob("*.py") if p.stem != "__init__"}
            assert set(namespace.get("__all__", ())) == modules - {m for m in modules if m.startswith("_")}, wing


def test_imports_point_down_or_sideways_never_up():
    rank = {wing: position for position, line in enumerate(WINGS) for wing in line}  # 0 = top
    upward = []
    for module, edges in package_imports().items():
        for target, line, _, _ in edges:
            source, wing = layer_of(module), layer_of(target)
            if source is None or wing is None or wing == source:
                continue  # unplaced modules are reported by the test above
            if rank[wing] <= rank[source]:
                upward.append(f"{module}:{line} ({source}) imports {target} ({wing})")
    assert not upward, "imports upward or between sibling wings:\n" + "\n".join(upward)


def test_no_import_circles_including_imports_inside_functions():
    graph = {module: sorted({target for target, *_ in edges}) for module, edges in package_imports().items()}
    # `from headlab import x` also runs headlab/__init__.py; that edge says nothing about structure.
    graph = {module: [t for t in targets if t != "headlab"] for module, targets in graph.items()}
    assert find_cycles(graph) == []


def test_imports_inside_functions_say_they_buy_start_up_time():
    silent = [
        f"{module}:{line} imports {target}"
        for module, edges in package_imports().items()
        for target, line, inside, around in edges
        if inside and not any(reason in around for reason in DEFERRED_REASONS)
    ]
    assert not silent, "function-level imports without a start-up comment:\n" + "\n".join(silent)


# Why an import may sit inside a function, one of which its comment must name: "start-up" (the import costs time a
# path that does not need it should not pay), "optional" (an extra that may not be installed), "platform" (a module
# some systems lack). A circle is no reason: test_no_import_circles_including_imports_inside_functions fails on one.
INSIDE_FUNCTION_REASONS = ("start-up", "optional", "platform")


def function_level_imports(source: str) -> list[tuple[int, str, str]]:
    """Every import statement (headlab's, third-party or standard library) inside a function of `source`, as
    (line, statement, comment): the comment text on its own line, or on the comment and import lines right above
    it (a comment may head a block of imports)."""
    lines = source.splitlines()
    found = {}
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in found:
                first = node.lineno - 1
                while first > 0 and lines[first - 1].strip().startswith(("from ", "import ", "#")):
                    first -= 1
                comment = " ".join(line.partition("#")[2] for line in lines[first : node.end_lineno])
                found[node.lineno] = (node.lineno, lines[node.lineno - 1].strip(), comment)
    return sorted(found.values())


def test_every_import_inside_a_function_says_why():
    silent = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {statement}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, statement, comment in function_level_imports(path.read_text())
        if not any(reason in comment for reason in INSIDE_FUNCTION_REASONS)
    ]
    assert not silent, (
        f"imports inside functions whose comment (same line, or heading the block) names no reason "
        f"({', '.join(INSIDE_FUNCTION_REASONS)}); move them to the top or say why:\n" + "\n".join(silent)
    )


def test_the_import_checker_reads_comments_on_the_line_and_above_only():
    source = (
        "def f():\n"
        "    # start-up: torch loads only when f runs\n"
        "    import torch\n"
        "    import numpy\n"
        "    x = 1  # optional\n"
        "    import json\n"
        "    import lm_eval  # optional extra\n"
        "def g():\n"
        '    """start-up is not said in a docstring."""\n'
        "    import pandas\n"
    )
    found = {statement: comment for _, statement, comment in function_level_imports(source)}
    assert set(found) == {
        "import torch",
        "import numpy",
        "import json",
        "import lm_eval  # optional extra",
        "import pandas",
    }
    assert "start-up" in found["import torch"] and "start-up" in found["import numpy"]  # one comment heads the block
    assert found["import json"].strip() == "" and found["import pandas"].strip() == ""
    assert "optional" in found["import lm_eval  # optional extra"]


# More parameters than this and a library function groups them into value objects (PruneSpec, Selection, SweepPlan,
# TaskSpec, TextSpec, ...). The CLI's commands are exempt: click passes every option as a parameter.
MAX_PARAMETERS = 12


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every named parameter (positional-only, ordinary, keyword-only), without self/cls, *args or **kwargs."""
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def test_no_library_function_takes_more_than_12_parameters():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({parameter_count(node)})"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "cli"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameter_count(node) > MAX_PARAMETERS
    ]
    assert not offenders, f"more than {MAX_PARAMETERS} parameters; group them in a value object:\n" + "\n".join(
        offenders
    )


def test_the_parameter_counter_skips_self_and_star_arguments():
    tree = ast.parse("class A:\n    def f(self, a, /, b, *args, c, d=1, **kwargs): ...\ndef g(cls): ...\n")
    counts = {n.name: parameter_count(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert counts == {"f": 4, "g": 0}


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks themselves, on a made-up graph: a loop is found, a straight chain is not."""
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert find_cycles({"a": ["b"], "b": ["c"], "c": []}) == []
    assert layer_of("headlab.cli.prune") == "cli" and layer_of("headlab.core.errors") == "core"
    assert layer_of("headlab.not_a_module") is None
