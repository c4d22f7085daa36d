"""Fail when the library's modules import each other in a cycle, hidden imports included.

The import-linter ``layers`` contract (``lint-imports``) keeps the layers in
order; this check covers what a layers contract cannot see: two modules of the
same layer (or of the same subpackage) that import each other, directly or
through others. It reads every import statement, at module level, inside
functions and under ``if TYPE_CHECKING:`` (grimp, the graph import-linter
builds), and prints each cycle it finds.

Run: ``python tools/import_cycles.py`` (``make test`` does).
"""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("asymstore", "asymcheck")


def cycles(graph: grimp.ImportGraph, skip: frozenset[str] = frozenset()) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; ``skip`` left out."""

    def imported_by(module: str) -> list[str]:
        return sorted(graph.find_modules_directly_imported_by(module) - skip)

    modules = sorted(graph.modules - skip)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(imported_by(root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(imported_by(child))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    """Print every import cycle of the library; exit 1 if there is one."""
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    # The two top-level packages re-export their public names lazily: facades for
    # users, not dependencies of the modules below them, so they are left out.
    found = cycles(graph, frozenset(PACKAGES))
    for component in found:
        print("import cycle: " + " <-> ".join(component))
    print(f"{len(found)} import cycles among {len(graph.modules) - len(PACKAGES)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
