"""The package's import structure, read from its own source: every module has a declared layer, imports point only
down or sideways within a layer, there are no circles, and an import inside a function says why (start-up time).

A new module fails here until it is placed in LAYERS: add one line under the layer its meaning asks for.
"""

from __future__ import annotations

import ast
from pathlib import Path

import headlab

PACKAGE = Path(headlab.__file__).parent

# Layers from the top; a module may import from its own layer or any layer below it (docs/design.md).
LAYER_ORDER = ["cli", "workflows", "capabilities", "mechanisms", "foundations", "base"]
LAYERS = {
    # cli: click commands (the whole headlab.cli package), parse options, call one workflow, print
    "headlab.cli": "cli",
    "headlab.__main__": "cli",
    # workflows: compose capabilities, evaluate, save
    "headlab.gqa": "workflows",
    "headlab.ladder": "workflows",
    "headlab.mla": "workflows",
    "headlab.prune": "workflows",
    "headlab.recover": "workflows",
    "headlab.report": "workflows",
    "headlab.speed": "workflows",
    "headlab.streaming": "workflows",
    "headlab.sweep": "workflows",
    "headlab.uptrain": "workflows",
    # capabilities: one analysis or edit each, on resolved objects
    "headlab.compensate": "capabilities",
    "headlab.costs": "capabilities",
    "headlab.evaluate": "capabilities",
    "headlab.gguf_export": "capabilities",
    "headlab.importance": "capabilities",
    "headlab.kv_heads": "capabilities",
    "headlab.lm_eval_bridge": "capabilities",
    "headlab.llamacpp": "capabilities",
    "headlab.merge": "capabilities",
    "headlab.plots": "capabilities",
    "headlab.obs": "capabilities",
    "headlab.reconstruct": "capabilities",
    "headlab.report_render": "capabilities",
    "headlab.scores": "capabilities",
    "headlab.selection": "capabilities",
    "headlab.stats": "capabilities",
    # mechanisms: how headlab reaches inside a running model
    "headlab.capture": "mechanisms",
    "headlab.gates": "mechanisms",
    "headlab.hooks": "mechanisms",
    "headlab.losses": "mechanisms",
    "headlab.recompute": "mechanisms",
    "headlab.restore": "mechanisms",
    # foundations: adapters, saved layouts, loading, text, tables, files, checkpoints
    "headlab.arch": "foundations",
    "headlab.checkpoint": "foundations",
    "headlab.data": "foundations",
    "headlab.fsio": "foundations",
    "headlab.layout": "foundations",
    "headlab.loading": "foundations",
    "headlab.reload_stream": "foundations",
    "headlab.report_text": "foundations",
    "headlab.tables": "foundations",
    "headlab.validate": "foundations",
    # base: imported by everything, imports nothing of headlab's but errors
    "headlab": "base",
    "headlab.distributed": "base",
    "headlab.errors": "base",
}
# Words one of which a comment on (or just above) a function-level import must contain.
DEFERRED_REASONS = ("start-up",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    """The declared layer of a module: its own entry, else its subpackage's (headlab.cli.prune -> cli)."""
    if module in LAYERS:
        return LAYERS[module]
    package = module.rpartition(".")[0]
    return LAYERS.get(package) if package != "headlab" else None


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The headlab modules an import statement names (`from headlab import gqa` names headlab.gqa)."""
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


def test_every_module_has_a_declared_layer():
    unplaced = [module for module in package_imports() if layer_of(module) is None]
    assert not unplaced, f"place these modules in tests/test_layers.py LAYERS: {unplaced}"
    assert set(LAYERS.values()) <= set(LAYER_ORDER)


def test_imports_point_down_or_sideways_never_up():
    rank = {layer: position for position, layer in enumerate(LAYER_ORDER)}  # 0 = top
    upward = []
    for module, edges in package_imports().items():
        for target, line, _, _ in edges:
            if layer_of(target) is None:
                continue  # reported by the test above
            if rank[layer_of(target)] < rank[layer_of(module)]:
                upward.append(f"{module}:{line} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


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


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks themselves, on a made-up graph: a loop is found, a straight chain is not."""
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert find_cycles({"a": ["b"], "b": ["c"], "c": []}) == []
    assert layer_of("headlab.cli.prune") == "cli" and layer_of("headlab.errors") == "base"
    assert layer_of("headlab.not_a_module") is None
