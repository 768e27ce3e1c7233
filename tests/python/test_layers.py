"""The module layering of the Python package (python/memsaver, docs/architecture.md), checked on
its sources as nccl-hook/tests/layers.rs checks the Rust crates: no module imports another that
imports it back, directly or not, so the modules form layers, each importing only modules below
it. A lazy import (inside a function) counts as much as one at the top of the module: it hides a
cycle, it does not remove it.

A module's imports are every ``import`` and ``from ... import`` in its code, wherever they are,
with relative imports resolved. ``from P import name`` imports the submodule ``P.name`` when
there is one, else the module ``P`` (a package's ``__init__``), which defines or re-exports
``name``. Modules are named by their path in the package: ``__init__`` is the package itself,
``compat.__init__`` the subpackage ``memsaver.compat``. The compiled extension (``_memsaver``,
known by its ``.pyi``) is a module that imports none of them.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PACKAGE = "memsaver"
SOURCE = Path(__file__).resolve().parents[2] / "python" / PACKAGE

Graph = dict[str, set[str]]


def modules(root: Path, package: str = PACKAGE) -> dict[str, tuple[str, Path | None]]:
    """Each module of the package at ``root``: dotted name -> (name used here, source or None
    for a compiled module known by its stub)."""
    found: dict[str, tuple[str, Path | None]] = {}
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.pyi")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        name = ".".join(parts)
        dotted = ".".join([package, *parts[:-1]] if parts[-1] == "__init__" else [package, *parts])
        if dotted in found:  # a .pyi next to its .py
            continue
        found[dotted] = (name, path if path.suffix == ".py" else None)
    return found


def imports(tree: ast.AST, dotted: str, is_package: bool, known: set[str], package: str = PACKAGE) -> set[str]:
    """The dotted names of the modules of ``package`` (``known``) that the module ``dotted``
    imports, anywhere in its code."""
    here = dotted if is_package else dotted.rpartition(".")[0]

    def within(name: str) -> str | None:
        # The module itself, or its longest known prefix (`memsaver.x.y` of a missing `y`).
        if name != package and not name.startswith(package + "."):
            return None
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        return name if name in known else None

    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                m = within(alias.name)
                if m:
                    out.add(m)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base_parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                m = sub if sub in known else within(base)
                if m:
                    out.add(m)
    out.discard(dotted)
    return out


def graph(root: Path = SOURCE, package: str = PACKAGE) -> Graph:
    """Each module of the package at ``root`` and the modules it imports (named by their path in
    the package, as ``modules`` names them)."""
    mods = modules(root, package)
    known = set(mods)
    g: Graph = {}
    for dotted, (name, path) in mods.items():
        deps: set[str] = set()
        if path is not None:
            tree = ast.parse(path.read_text(), str(path))
            deps = {mods[d][0] for d in imports(tree, dotted, path.name == "__init__.py", known, package)}
        g[name] = deps
    return g


def reach(g: Graph, m: str) -> set[str]:
    """Every module ``m`` reaches through its imports."""
    seen: set[str] = set()
    todo = [m]
    while todo:
        for d in g.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def path_back(g: Graph, m: str) -> list[str] | None:
    """A shortest chain of imports from ``m`` back to ``m``, or None."""
    prev: dict[str, str] = {}
    todo = deque([m])
    while todo:
        n = todo.popleft()
        for d in sorted(g.get(n, ())):
            if d == m:
                chain = [n]
                while chain[-1] != m:
                    chain.append(prev[chain[-1]])
                return [m, *reversed(chain[:-1]), m]
            if d not in prev:
                prev[d] = n
                todo.append(d)
    return None


def cycles(g: Graph) -> list[str]:
    """The import cycles: each module that reaches itself, with a chain of imports back."""
    out = []
    for m in sorted(g):
        chain = path_back(g, m)
        if chain is not None:
            out.append(" -> ".join(chain))
    return out


def test_the_parser_sees_imports_and_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\nfrom .b import f\n")
    (pkg / "a.py").write_text(
        '"""import memsaver.c"""\nimport os\nfrom . import _ext\n'
        "def g():\n    from . import f  # defined in b, re-exported by __init__\n"
    )
    (pkg / "b.py").write_text("def f():\n    from .sub import d, name\n    from vllm import x\n")
    (pkg / "c.py").write_text("import memsaver\nfrom memsaver import b\nimport memsaver.sub.d\n")
    (pkg / "_ext.pyi").write_text("from memsaver import c\n")  # a stub: not the module's code
    (pkg / "sub" / "__init__.py").write_text("from .. import _ext\nfrom .d import *\n")
    (pkg / "sub" / "d.py").write_text("from .._ext import h\n")
    g = graph(pkg)
    assert g == {
        "__init__": {"a", "b"},
        "a": {"_ext", "__init__"},
        "b": {"sub.__init__", "sub.d"},
        "c": {"__init__", "b", "sub.d"},
        "_ext": set(),
        "sub.__init__": {"_ext", "sub.d"},
        "sub.d": {"_ext"},
    }, g
    assert reach(g, "c") == set(g) - {"c"}
    assert cycles(g) == ["__init__ -> a -> __init__", "a -> __init__ -> a"]
    g["a"].discard("__init__")
    assert cycles(g) == []
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [
        "x -> y -> z -> x",
        "y -> z -> x -> y",
        "z -> x -> y -> z",
    ]


def test_the_package_has_no_import_cycle() -> None:
    g = graph()
    # The parse saw the package: its modules and some imports known to exist.
    assert {"__init__", "_api", "_core", "control", "profile", "timeline", "compat.__init__"} <= set(g), g
    assert "_core" in g["_api"] and "_memsaver" in g["_core"] and "control" in g["__init__"], g
    found = cycles(g)
    imports_ = "\n".join(f"  {m} -> {', '.join(sorted(d))}" for m, d in sorted(g.items()))
    assert not found, "import cycles:\n  " + "\n  ".join(found) + "\nthe imports:\n" + imports_


def test_the_library_loader_imports_nothing_above_it() -> None:
    """``_core`` loads libmemsaver.so for every other module: what must happen once the library
    is loaded (the control runner) registers itself with it instead of being called from it."""
    g = graph()
    assert reach(g, "_core") <= {"_memsaver"}, g["_core"]
