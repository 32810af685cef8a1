#!/usr/bin/env python3
"""Prints the graph of the service's top-level modules (who uses whom, from `crate::`
paths in src/) and fails if it has a cycle. Run by `make lint`; `--dot` prints Graphviz.

A cycle means two modules can only be understood, changed and tested together; the layout
in src/lib.rs promises a graph that reads from the leaves (names, strategy, events) up to
the server."""
import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"


def module_of(path: pathlib.Path) -> str | None:
    rel = path.relative_to(SRC)
    if rel.parts[0] in ("main.rs", "lib.rs"):
        return None
    return rel.parts[0].removesuffix(".rs")


def uses(text: str) -> set[str]:
    # Drop comments, then read `crate::x` and `crate::{x, y::z}` paths.
    text = re.sub(r"//.*", "", text)
    found = set(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", text))
    for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
        found.update(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.rs")):
        module = module_of(path)
        if module is None:
            continue
        edges.setdefault(module, set())
        for used in uses(path.read_text()):
            if used != module:
                edges[module].add(used)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in edges:
                continue
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    edges = graph()
    if "--dot" in sys.argv:
        print("digraph modules {")
        for m, used in sorted(edges.items()):
            for u in sorted(used):
                print(f'  "{m}" -> "{u}";')
        print("}")
    else:
        for m, used in sorted(edges.items()):
            print(f"{m:12} -> {', '.join(sorted(used)) or '(leaf)'}")
    found = cycles(edges)
    for c in found:
        print(f"import cycle among modules: {' <-> '.join(c)}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
