"""Tests reach nbtools through public names (docs/CONTRACT.md, "Test seams"): no test imports a
private name of nbtools, or reads, replaces or looks up one on an nbtools module it imported."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(source: str) -> list:
    """``(line, what)`` of each private name of nbtools the module's code imports, or reaches
    through a name bound to an nbtools module (``import nbtools.x as y``, ``from nbtools import
    x``): ``y._f``, ``monkeypatch.setattr(y, "_f", ...)``, ``getattr(y, "_f")``."""
    tree = ast.parse(source)
    modules = set()                     # local names bound to nbtools modules (or the package)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "nbtools":
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nbtools":
            for a in node.names:
                if _private(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                elif a.name[:1].islower():      # (a module or function; classes are CamelCase)
                    modules.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and \
                isinstance(node.value, ast.Name) and node.value.id in modules:
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and \
                isinstance(node.args[0], ast.Name) and node.args[0].id in modules and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value) and \
                ast.unparse(node.func).split(".")[-1] in ("setattr", "getattr", "delattr"):
            found.append((node.lineno, f"{ast.unparse(node.func)}({node.args[0].id}, "
                                       f"{node.args[1].value!r})"))
    return found


def test_the_check_finds_private_uses():
    source = ("import nbtools.disk as d\nfrom nbtools import hostmem\nfrom nbtools.x import _y\n"
              "d._load\nmonkeypatch.setattr(hostmem, '_register', None)\nhostmem.cuda_register\n"
              "torch._C\nself._x\n")
    assert [w for _, w in _private_uses(source)] == [
        "from nbtools.x import _y", "d._load", "monkeypatch.setattr(hostmem, '_register')"]


def test_tests_use_public_names_of_nbtools():
    found = [f"{path.relative_to(TESTS)}:{line}: {what}"
             for path in sorted(TESTS.rglob("*.py"))
             for line, what in _private_uses(path.read_text())]
    assert not found, "tests reach private names of nbtools (give them public ones):\n" + \
        "\n".join(found)


# --- the wings are layered: no import runs against the order docs/CONTRACT.md states ------------

import re

from test_package import import_graph

CONTRACT = TESTS.parent / "docs" / "CONTRACT.md"


def floors() -> dict:
    """``{top-level name: floor}`` from the one line of docs/CONTRACT.md that states the order
    (``Floors: a < b = c < d``: ``=`` shares a floor, ``<`` starts the next one up)."""
    line = next(l for l in CONTRACT.read_text().splitlines() if l.startswith("Floors:"))
    order = line.split(":", 1)[1].strip().strip("`")
    return {name.strip(): i for i, floor in enumerate(order.split("<"))
            for name in floor.split("=")}


def against_the_order(graph: dict, floor: dict) -> list:
    """``(importer, imported)`` for each import of a module on a higher floor. A module's floor is
    that of its top-level name (``nbtools.disk.gpu`` is on ``disk``'s); the package's own
    ``__init__`` (``NbtoolsError``, the lazy doors) is below every floor."""
    def of(module):
        parts = module.split(".")
        return -1 if len(parts) == 1 else floor[parts[1]]
    return sorted((a, b) for a, bs in graph.items() for b in bs if of(b) > of(a))


def test_the_order_check_finds_an_import_upwards():
    floor = {"units": 0, "store": 1, "engine": 2}
    graph = {"nbtools.store.tiers": {"nbtools.engine.capture", "nbtools.units"},
             "nbtools.engine": {"nbtools.store", "nbtools"}}
    assert against_the_order(graph, floor) == [("nbtools.store.tiers", "nbtools.engine.capture")]


def test_every_module_has_a_floor():
    placed = floors()
    unplaced = sorted({m.split(".")[1] for m in import_graph(lazy=True) if "." in m} - set(placed))
    assert not unplaced, f"top-level names docs/CONTRACT.md's Floors line leaves out: {unplaced}"


def test_no_import_runs_against_the_floors():
    found = against_the_order(import_graph(lazy=True), floors())
    assert not found, "imports against docs/CONTRACT.md's Floors line " \
        "(move the helper down, or ask through a seam):\n" + \
        "\n".join(f"{a} -> {b}" for a, b in found)
