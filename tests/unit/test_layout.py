"""The package's rooms import one way (README, Layout): protocol <- format <- wire <- planning <- engine <- layouts <- backends
<- call sequences <- manager / cli / convert; no function-level imports of the package's own modules; no private
names imported from another room."""

import ast
import pathlib

import distckpt

SRC = pathlib.Path(distckpt.__file__).parent
PROTOCOL = {"metadata", "planner", "storage", "stateful", "errors", "knobs", "capabilities", "gc_pause", "progress",
            "faults"}
TOP = {"manager", "cli", "convert", "optim", "format_utils", "tiers", "__init__", "__main__"}
ORDER = ["protocol", "format", "columns", "wire", "planning", "engine", "layouts", "backends", "sequences", "top", "integrations",
         "testing", "demo"]
LAZY_OK: set = set()  # (module, imported) pairs allowed inside functions: none today


def _room(module: str) -> str:
    first = module.split(".")[0]
    if first == "item_columns":
        return "columns"
    if first in ORDER:
        return first
    return "protocol" if first in PROTOCOL else "top" if first in TOP else "sequences"


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
