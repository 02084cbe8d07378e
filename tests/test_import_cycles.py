"""No module of tokenmill takes part in an import cycle.

The import graph is grimp's (import-linter's): every import a module's source holds counts, at
module level or inside a function, and ``if TYPE_CHECKING:`` ones too. A cycle is a set of modules
each reaching every other one by imports (a strongly connected component of more than one module,
or a module importing itself); the failure names each one with a shortest cycle through it and the
lines of its imports.
"""

from __future__ import annotations

import grimp

PACKAGE = "tokenmill"


def strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of the graph ``edges`` (module -> the modules it imports), iteratively."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(edges[root])))]
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = lowlink[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    lowlink[node] = min(lowlink[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    lowlink[parent] = min(lowlink[parent], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def import_graph() -> tuple[grimp.ImportGraph, dict[str, set[str]]]:
    graph = grimp.build_graph(PACKAGE, cache_dir=None)  # no cache: always the files as they are
    modules = graph.modules
    edges = {module: graph.find_modules_directly_imported_by(module, as_package=False) & modules for module in modules}
    return graph, edges


def describe_cycle(graph: grimp.ImportGraph, component: list[str], edges: dict[str, set[str]]) -> str:
    """The component's modules and one shortest cycle through its first, each import with its line."""
    start = component[0]
    cycle: tuple[str, ...] | None = None
    for succ in sorted(edges[start] & set(component)):  # a self-import is the chain (start,)
        back = (start,) if succ == start else graph.find_shortest_chain(succ, start, as_packages=False)
        if back is not None and (cycle is None or len(back) + 1 < len(cycle)):
            cycle = (start, *back)
    assert cycle is not None, "a component of several modules holds a cycle through each"
    steps = []
    for importer, imported in zip(cycle, cycle[1:]):
        lines = sorted(
            {detail["line_number"] for detail in graph.get_import_details(importer=importer, imported=imported)}
        )
        steps.append(f"    {importer} -> {imported} (line {', '.join(map(str, lines))})")
    return f"  {', '.join(component)}:\n" + "\n".join(steps)


def test_strongly_connected_components_finds_cycles_and_self_imports() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    components = strongly_connected_components(edges)
    assert sorted(components) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_module_takes_part_in_an_import_cycle() -> None:
    graph, edges = import_graph()
    cycles = [
        component
        for component in strongly_connected_components(edges)
        if len(component) > 1 or component[0] in edges[component[0]]
    ]
    report = "\n".join(describe_cycle(graph, component, edges) for component in sorted(cycles))
    assert not cycles, f"import cycles in {PACKAGE} (each: its modules, then one cycle through them):\n{report}"
