"""The package's shape, checked: no import cycle anywhere (imports inside functions count: they
hide cycles rather than remove them), and the server reaches the engine only through its surface.

Imports are read with `ast`, so nothing is imported to check them."""

from __future__ import annotations

import ast
from pathlib import Path

import minivllm

PACKAGE_DIR = Path(minivllm.__file__).parent
# what server/ may import from the rest of the package: the engine's surface, the wire types and
# the modules that read them, request parameters and text utilities
SERVER_MAY_IMPORT = {
    "minivllm.engine.api",
    "minivllm.events.types",
    "minivllm.events.recording",
    "minivllm.events.fold",
    "minivllm.sampling.params",
    "minivllm.text.tokenizer_utils",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules this file imports, wherever the import statement is."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:  # `from minivllm.events import types as events` names a module, not an attribute
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
    return {m for m in found if m in modules and m != module_name(path)}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["minivllm.engine.llm_engine"], "the graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The package order, bottom first: a package may import its own layer's modules and any layer below
# it, never one above (imports inside functions count). Root modules are placed one by one.
LAYERS: list[set[str]] = [
    {"arith", "cache", "console", "cpuinfo", "env", "errors", "malloc_tuning"},  # helpers with no package deps
    {"kernels"},  # C++ and Triton kernels
    {"quant"},  # weight formats, the kernel paths a weight may take, the chooser
    {"model"},  # the decoder and its attention, built from the formats
    {"loader"},  # checkpoints and GGUF files into a model
    {"events", "text", "structured"},  # wire events, tokenizer helpers, grammars
    {"sampling"},
    {"core"},  # requests, scheduler, KV blocks, step work
    {"spec_decode"},  # speculative decoding, over a runner protocol
    {"engine"},
    {"engine_args", "server", "bench"},  # engine_args: the CLI flags both serve and bench take
    {"llm", "cli_chat", "schema", "cli", "__main__", ""},  # entry points ("" is the package's __init__)
]


def layer_of(module: str) -> int:
    """The layer of `minivllm.<part>...`: its subpackage's, or the root module's own."""
    part = module.split(".")[1] if "." in module else ""
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    raise AssertionError(f"{module} is in no layer: add `{part}` to LAYERS")


def test_packages_import_only_their_own_layer_or_below():
    graph = import_graph()
    upward = [
        f"{name} -> {dep}"
        for name, deps in sorted(graph.items())
        for dep in sorted(deps)
        if layer_of(dep) > layer_of(name)
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert (
        layer_of("minivllm.engine.llm_engine") > layer_of("minivllm.spec_decode.factory") > layer_of("minivllm.quant")
    )
    assert layer_of("minivllm") == len(LAYERS) - 1 and layer_of("minivllm.errors") == 0


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_server_reaches_the_engine_only_through_its_surface():
    graph = import_graph()
    server = {name: deps for name, deps in graph.items() if name.startswith("minivllm.server")}
    assert server, "no server modules found"
    for name, deps in server.items():
        outside = {d for d in deps if not d.startswith("minivllm.server")} - SERVER_MAY_IMPORT
        assert not outside, f"{name} imports {sorted(outside)}: go through minivllm.engine.api"


def test_bench_builds_engines_through_the_factory_and_uses_no_core_or_quant_internals():
    """Benchmarks measure what users run: engines from `engine.factory`, types from `engine.api`."""
    graph = import_graph()
    bench = {name: deps for name, deps in graph.items() if name.startswith("minivllm.bench")}
    assert len(bench) > 10, "no bench modules found"
    for name, deps in bench.items():
        internal = sorted(d for d in deps if d.startswith(("minivllm.core", "minivllm.quant")))
        assert not internal, f"{name} imports {internal}: widen engine.api instead"
    for path in (PACKAGE_DIR / "bench").rglob("*.py"):
        calls = [
            n
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "LLMEngine"
        ]
        assert not calls, f"bench/{path.name} builds LLMEngine(...) itself: use engine.factory"


def test_the_engine_loop_stays_small():
    """Counted in statements, not lines, so that formatting does not move the bar."""
    tree = ast.parse((PACKAGE_DIR / "engine" / "llm_engine.py").read_text())
    statements = sum(isinstance(node, ast.stmt) for node in ast.walk(tree))
    assert statements <= 175, f"engine/llm_engine.py has {statements} statements: move a concern into its own module"


def test_the_server_uses_no_escape_hatch_into_the_engine():
    """`AsyncEngine.call(fn)` runs anything on the engine thread and `AsyncEngine.engine` is the
    engine itself: server code uses the named methods instead, so the surface stays narrow."""
    for path in (PACKAGE_DIR / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("call", "engine"):
                owner = ast.unparse(node.value)
                # ServerState.engine() (the running AsyncEngine) and ServerConfig.engine are the server's own
                allowed = node.attr == "engine" and owner in ("server", "server_of(request)", "self.config")
                assert allowed, f"{path.name} reaches into the engine: {owner}.{node.attr}"
