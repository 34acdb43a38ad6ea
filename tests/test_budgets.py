"""The code's size and shape budgets (docs/design.md §4), held on every run so a feature cannot break them silently:
class ≤ 200 lines, function ≤ 50, module ≤ 400, ≤ 12 modules per folder, no import circle between shardopt's
modules, and imports inside functions only of optional dependencies (the frameworks, DeepSpeed, torchft)."""

import ast
import pathlib

import shardopt

PACKAGE = pathlib.Path(shardopt.__file__).parent
MAX_CLASS, MAX_FUNCTION, MAX_MODULE, MAX_MODULES_PER_FOLDER = 200, 50, 400, 12
OPTIONAL = ("deepspeed", "transformers", "accelerate", "lightning", "torchtitan", "torchft")


def _modules() -> dict[str, ast.Module]:
    """Dotted name → parsed source of every module of the package (a package by its __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("shardopt", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text()))
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name][0].name == "__init__.py"


def _sizes(kind) -> dict[str, int]:
    return {f"{name}.{node.name}": node.end_lineno - node.lineno + 1 for name, (_, tree) in MODULES.items()
            for node in ast.walk(tree) if isinstance(node, kind)}


def test_every_class_is_at_most_200_lines():
    over = {name: lines for name, lines in _sizes(ast.ClassDef).items() if lines > MAX_CLASS}
    assert over == {}, f"classes over {MAX_CLASS} lines: {over}; a feature goes into a module and one object, not the class"


def test_every_function_is_at_most_50_lines():
    over = {name: lines for name, lines in _sizes((ast.FunctionDef, ast.AsyncFunctionDef)).items() if lines > MAX_FUNCTION}
    assert over == {}, f"functions over {MAX_FUNCTION} lines: {over}"


def test_every_module_is_at_most_400_lines():
    over = {str(path.relative_to(PACKAGE)): n for path, _ in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE}
    assert over == {}, f"modules over {MAX_MODULE} lines: {over}"


def test_every_folder_holds_at_most_12_modules():
    folders = {}
    for path, _ in MODULES.values():
        if path.name != "__init__.py":
            folders.setdefault(str(path.parent.relative_to(PACKAGE)), []).append(path.name)
    over = {folder: len(names) for folder, names in folders.items() if len(names) > MAX_MODULES_PER_FOLDER}
    assert over == {}, f"folders over {MAX_MODULES_PER_FOLDER} modules: {over}"


def _imported(name: str, tree: ast.Module) -> set[str]:
    """The shardopt modules `name` imports (anywhere in it), each resolved to the module file it names."""
    package = name if _is_package(name) else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name.startswith("shardopt")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("shardopt"):
                module = node.module
            else:
                continue
            submodules = {f"{module}.{alias.name}" for alias in node.names} & MODULES.keys()
            targets |= submodules or {module}
    return {target for target in targets if target in MODULES and target != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None
    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_between_shardopt_modules():
    """Edges to a package's __init__ that is an ancestor of the importer are Python's own, not the code's."""
    graph = {name: {target for target in _imported(name, tree) if not name.startswith(target + ".")}
             for name, (_, tree) in MODULES.items()}
    assert _cycle(graph) is None, f"import circle: {' → '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_are_of_optional_dependencies_only():
    lazy = {}
    for name, (_, tree) in MODULES.items():
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                    ["." + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
                lazy.setdefault(name, []).extend(m for m in modules if m.split(".")[0] not in OPTIONAL)
    lazy = {name: found for name, found in lazy.items() if found}
    assert lazy == {}, f"imports inside functions that are not optional dependencies (import them at the top): {lazy}"
