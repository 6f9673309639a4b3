"""The package's modules import one another without a cycle.

A cycle through ``fastattn/__init__.py`` (a module that the package imports, importing the
package back, even inside a function) works only while every name it needs happens to be
set by the time it runs; ``fastattn.cli`` and ``fastattn.integrations`` import the library
and are never imported by it.  The graph is read from the source (every ``import``,
top-level or not), so an import that only runs on some path counts too.
"""
import ast
import pathlib

import fastattn

PACKAGE = pathlib.Path(fastattn.__file__).parent


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """{module: set of fastattn modules it imports}; importing ``fastattn.x.y`` runs the
    packages above it first, so it counts as importing each of them that is not already
    importing."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    # The compiled kernels (named by their stubs) import nothing of the package.
    compiled = {_module_name(p) for p in PACKAGE.glob("_kernel_*.pyi")}

    def with_parents(name):
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & (modules.keys() | compiled)

    graph = dict.fromkeys(compiled, set())
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        # A module's own parent packages are importing already when it runs: reaching one
        # on the way to a sibling is no edge, naming one (`import fastattn`, `from . import
        # __version__`) is.
        own = with_parents(name)

        def target(module):
            return {module} | (with_parents(module) - own)

        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules.keys() | compiled:
                        edges |= target(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base not in modules:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    # `from . import _threads` imports a submodule; `from . import x` of a
                    # name the package defines needs the package itself.
                    edges |= target(sub if sub in modules.keys() | compiled else base)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph):
    """One cycle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "fastattn._machine.config" in graph["fastattn"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_the_package():
    # The shape of the cycle this file guards against: the package imports a module that
    # imports the package back inside a function.
    graph = {"fastattn": {"fastattn._machine.config"}, "fastattn._machine.config": {"fastattn"}}
    assert find_cycle(graph) == ["fastattn", "fastattn._machine.config", "fastattn"]
    assert find_cycle({"fastattn": {"fastattn._machine.config"}, "fastattn._machine.config": set()}) is None
