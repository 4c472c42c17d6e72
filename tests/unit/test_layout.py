"""The package's rooms import one way (README, Layout): protocol <- format <- columns <- wire <- planning <- engine <- layouts <- backends
<- call sequences <- on top <- DCP's module names; no function-level imports of the package's own modules; no private
names imported from another room; no import circles; no function over 80 lines. Every root module is placed in a room by
name: a new one is a decision."""

import ast
import pathlib

import distckpt

SRC = pathlib.Path(distckpt.__file__).parent
ORDER = ["protocol", "format", "columns", "wire", "planning", "engine", "layouts", "backends", "sequences", "top", "dcp_names",
         "integrations", "testing", "demo"]
# every module at the package's root, and every subpackage that is not a room of its own, with its room
ROOMS = {
    "item_columns": "columns",  # the one schema of plan items as columns: wire encodes it, planning plans on it
    **dict.fromkeys(["metadata", "planner", "storage", "stateful", "errors", "extras", "knobs", "capabilities",
                     "gc_pause", "progress", "faults", "process_state", "events"], "protocol"),
    **dict.fromkeys(["saving", "loading", "async_saving", "staging", "distributed", "verification", "streaming",
                     "_sequence", "torch_classes", "torch_save_reader", "stored_bytes", "writer_process", "stall_census",
                     "prefetching"],
                   "sequences"),
    **dict.fromkeys(["manager", "cli", "convert", "optim", "tiers", "opening", "diffing", "compaction", "run_references",
                     "metrics", "__init__"], "top"),
    # DCP's module names, each a face over the rooms (torch.distributed.checkpoint.<name>); nothing imports them
    **dict.fromkeys(["api", "filesystem", "default_planner", "planner_helpers", "state_dict_loader", "state_dict_saver",
                     "_extension", "_dedup_save_plans", "utils", "format_utils"], "dcp_names"),
}
LAZY_OK: set = set()  # (module, imported) pairs allowed inside functions: none today
MAX_FUNCTION_LINES = 80
LONG_OK: set = set()  # "path:function" allowed over MAX_FUNCTION_LINES: none


def _room(module: str) -> str:
    first = module.split(".")[0]
    if first in ORDER:
        return first
    if first not in ROOMS:
        raise AssertionError(f"distckpt.{first} is in no room: place it in ROOMS in tests/unit/test_layout.py "
                             "(and in README's Layout section)")
    return ROOMS[first]


def test_every_root_module_is_placed_in_a_room_by_name():
    found = {path.stem for path in SRC.glob("*.py")} | {path.name for path in SRC.iterdir()
                                                          if path.is_dir() and (path / "__init__.py").exists()}
    unplaced = sorted(name for name in found if name not in ROOMS and name not in ORDER)
    assert not unplaced, f"place each of {unplaced} in ROOMS in tests/unit/test_layout.py (and in README's Layout section)"
    gone = sorted(name for name in ROOMS if name not in found)
    assert not gone, f"ROOMS places modules that do not exist: {gone}"


def _imports():
    """(importing module, imported module, imported names, at module level) for every import of distckpt's own modules."""
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = module if rel.name == "__init__" else ".".join(rel.parts[:-1])
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("distckpt"):
                target = node.module[len("distckpt."):] if node.module != "distckpt" else ""
            else:
                continue
            names = [a.name for a in node.names]
            targets = []
            for name in names:
                full = f"{target}.{name}" if target else name
                is_module = (SRC / (full.replace(".", "/") + ".py")).exists() or (SRC / full.replace(".", "/")).is_dir()
                targets.append((full if is_module else target or "__init__", name, is_module))
            for imported, name, is_module in targets:
                yield module or "__init__", imported, name, is_module, id(node) in top_level


def test_rooms_import_one_way():
    wrong = set()
    for module, imported, _, _, _ in _imports():
        a, b = _room(module), _room(imported)
        if a != b and ORDER.index(b) > ORDER.index(a) and not (a == "demo" and b == "testing"):
            wrong.add(f"{module} ({a}) imports {imported} ({b})")
    assert not wrong, sorted(wrong)


def test_no_function_level_imports_of_own_modules_and_no_private_names_across_rooms():
    lazy, private = set(), set()
    for module, imported, name, is_module, top_level in _imports():
        if not top_level and (module, imported) not in LAZY_OK:
            lazy.add(f"{module}: {imported}")
        if name.startswith("_") and not is_module and _room(module) != _room(imported) and name != "__version__":
            private.add(f"{module} imports {imported}.{name}")
    assert not lazy, sorted(lazy)
    assert not private, sorted(private)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (a package is its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for module, imported, _, _, top_level in _imports():
        graph.setdefault(module, set())
        if top_level and imported != module:
            graph[module].add(imported)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                        out.append(sorted(component))
    return out


def test_circles_are_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_modules():
    circles = _circles(_module_graph())
    assert not circles, circles


def test_no_function_over_80_lines():
    long = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                name = f"{path.relative_to(SRC)}:{node.name}"
                if lines > MAX_FUNCTION_LINES and name not in LONG_OK:
                    long[name] = lines
    assert not long, f"cut these into named steps: {long}"
