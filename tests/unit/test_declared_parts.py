"""Optional parts of the protocol objects are declared, never probed (issue 46, item 4).

An optional method is a capability (``distckpt.capabilities``) or a base-class method with a default; an
attribute is set in ``__init__`` or given a class default. So no ``getattr(obj, "name", ...)`` or
``hasattr(obj, "name")`` in src/ may name a method or attribute of the protocol objects (StorageWriter,
StorageReader, SavePlanner, LoadPlanner, BlobStore, and distckpt's classes that derive from them or that
they mix in), except where the object is not one of ours: the allowlist below, each with its reason.
"""

import ast
import functools
import pathlib

import distckpt

SRC = pathlib.Path(distckpt.__file__).parent
ROOTS = {"StorageWriter", "StorageReader", "SavePlanner", "LoadPlanner", "BlobStore"}

# (module path under src/distckpt, attribute name): why the probe is legitimate
ALLOWED = {
    ("torch_classes.py", "sync_files"): "reads the options of DCP's own FileSystemWriter, not one of ours",
    ("torch_classes.py", "thread_count"): "reads the options of DCP's own writers and readers",
    ("torch_classes.py", "overwrite"): "reads the options of DCP's own FileSystemWriter",
    ("torch_classes.py", "flatten_state_dict"): "reads the options of DCP's own default planners",
    ("torch_classes.py", "flatten_sharded_tensors"): "reads the options of DCP's own default planners",
    ("torch_classes.py", "allow_partial_load"): "reads the options of DCP's own DefaultLoadPlanner",
    ("torch_classes.py", "fqn_to_index_mapping"): "reads the options of DCP's own HuggingFaceStorageWriter",
    ("torch_classes.py", "checkpoint_id"): "reads the options of DCP's own BroadcastingTorchSaveReader",
    ("layouts/dcp.py", "storage_meta"): "reads DCP's unpickled Metadata, whose fields differ across torch versions",
    ("layouts/dcp.py", "save_id"): "reads DCP's unpickled StorageMeta, whose fields differ across torch versions",
    ("layouts/dcp.py", "sizes"): "reads DCP's unpickled chunk metadata, checked field by field",
    ("torch_classes.py", "coordinator_rank"): "reads the options of DCP's own BroadcastingTorchSaveReader",
    ("torch_classes.py", "extension_registry"): "reads the stream transforms of DCP's own FileSystemReader",
    ("capabilities.py", "capabilities"): "supports() reads the declaration itself; DCP's protocol bases declare none",
    ("cli.py", "layout"): "reads Metadata.storage_data, which belongs to whichever storage layer read it (Any)",
    ("cli.py", "save_id"): "reads Metadata.storage_data, which belongs to whichever storage layer read it (Any)",
    ("backends/foreign.py", "metadata"): "any LoadPlanner, DCP's protocol bases included: DynamicMetaLoadPlanner's own metadata",
    ("torch_save_reader.py", "flatten_state_dict"): "any LoadPlanner, DCP's protocol bases included (DCP's reader reads it so)",
    ("torch_save_reader.py", "allow_dtype_conversion"): "any LoadPlanner, DCP's protocol bases included (DCP's reader reads it so)",
}


@functools.lru_cache(maxsize=1)
def _modules() -> tuple:
    """(module, its syntax tree) of every source file: parsed once for the three tests."""
    return tuple((path.relative_to(SRC).as_posix(), ast.parse(path.read_text())) for path in sorted(SRC.rglob("*.py")))


def _base_names(cls: ast.ClassDef) -> set[str]:
    out = set()
    for b in cls.bases:
        if isinstance(b, ast.Name):
            out.add(b.id)
        elif isinstance(b, ast.Attribute):
            out.add(b.attr)
    return out


def _members(cls: ast.ClassDef) -> set[str]:
    """Methods, class attributes, and ``self.X`` assigned in any method."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


@functools.lru_cache(maxsize=1)
def protocol_names() -> frozenset:
    """Every member of the protocol classes, of distckpt's classes deriving from them, and of what those mix in."""
    classes: dict[str, list[ast.ClassDef]] = {}
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    protocol = set(ROOTS)
    grown = True
    while grown:  # subclasses, by name
        before = len(protocol)
        protocol |= {name for name, defs in classes.items() if any(_base_names(c) & protocol for c in defs)}
        grown = len(protocol) > before
    ancestors = set(protocol)
    grown = True
    while grown:  # and the classes they derive from (mixins)
        before = len(ancestors)
        ancestors |= {b for name in list(ancestors) for c in classes.get(name, []) for b in _base_names(c) if b in classes}
        grown = len(ancestors) > before
    return frozenset({m for name in ancestors for c in classes.get(name, []) for m in _members(c)} - {"__init__"})


def probes():
    """(module, name, line) of every getattr/hasattr call whose attribute is a string literal."""
    for module, tree in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                yield module, node.args[1].value, node.lineno


def test_the_scan_sees_the_protocol():
    names = protocol_names()
    assert {"write_data", "read_data", "discard_incomplete", "plan_cache", "store", "save_id", "open_store",
            "partly_read_chunks", "incomplete_saves"} <= names


def test_no_protocol_part_is_probed():
    names = protocol_names()
    found = sorted(f"{module}:{line} probes {name!r}" for module, name, line in probes()
                   if name in names and (module, name) not in ALLOWED)
    assert not found, "declare these (capabilities.py, or a default in the class) instead of probing:\n" + "\n".join(found)


def test_every_allowlist_entry_is_still_needed():
    names = protocol_names()
    used = {(module, name) for module, name, _ in probes() if name in names}
    assert not set(ALLOWED) - used, sorted(set(ALLOWED) - used)
