"""The package's layers, read from the source: no import cycles between tinyloop's parts, and the engine,
model and quantization code never reach the server.

A part is a subpackage (model, quant, engine, server, train, tools) or a top-level module (modelfile,
config, tokenizer, errors, ...); "tinyloop" is the package root, the public facade. Every import counts,
function-level and TYPE_CHECKING ones included, because a cycle through a lazy import is still a cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tinyloop

SRC = Path(tinyloop.__file__).parent
LOWER = ("engine", "model", "quant")  # never import the server


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(tinyloop module, line) for every import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{module}.{alias.name}"
                out.append((sub if is_module(sub) else module, node.lineno))
    return [(m, line) for m, line in out if m == "tinyloop" or m.startswith("tinyloop.")]


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tinyloop"


def part_graph() -> dict[str, dict[str, str]]:
    """part -> {imported part: "file:line" of one import that makes the edge}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(SRC.rglob("*.py")):
        src = part(module_name(path))
        for module, line in imported_modules(path):
            dst = part(module)
            if dst != src:
                graph[src].setdefault(dst, f"{path.relative_to(SRC.parent)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, dict[str, str]], start: str) -> dict[str, list[str]]:
    """Every part `start` reaches, with one import chain (file:line per step) that reaches it."""
    seen: dict[str, list[str]] = {start: []}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt, where in graph.get(node, {}).items():
            if nxt not in seen:
                seen[nxt] = seen[node] + [where]
                todo.append(nxt)
    return seen


def test_the_graph_sees_function_level_and_relative_imports():
    graph = part_graph()
    # modelfile builds the model inside load_model (a function-level `from .model import ...`)
    assert "model" in graph["modelfile"]
    assert {"engine", "modelfile"} <= set(graph["server"]) and "engine" in graph["cli"]


def test_no_import_cycle_between_parts():
    graph = part_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_engine_model_quant_never_reach_the_server():
    graph = part_graph()
    for low in LOWER:
        chain = reachable(graph, low).get("server")
        assert chain is None, f"{low} reaches the server through {chain}"


# The model owns the forward: the engine core builds step metadata and samples; it has no attention,
# normalisation, MLP, rotary or cache-slot arithmetic of its own (issue 13).
MODEL_MATH = {"scaled_dot_product_attention", "rms_norm", "layer_norm", "silu", "gelu", "softmax_attention",
              "apply_rope", "apply_rope_full", "cos_sin", "n_prelude", "n_core", "n_coda", "wqkv", "wq", "wk",
              "wv", "wo", "w_gate_up", "w_down", "core_loop", "embed_prelude", "run_coda"}


def test_the_engine_core_has_no_model_math_of_its_own():
    found = []
    for name in ("batch", "serving", "speculative", "scheduler"):
        path = SRC / "engine" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            ident = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if ident in MODEL_MATH:
                found.append(f"engine/{name}.py:{node.lineno} {ident}")
    assert not found, found
