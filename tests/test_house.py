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


# --- inside disk/, RamSlots' state changes only through its own verbs (issue 58) --------------

DISK = TESTS.parent / "nbtools" / "disk"

# methods that change the array, list or deque they are called on (and torch's in-place ones,
# named with a trailing underscore)
_MUTATORS = {"append", "appendleft", "extend", "extendleft", "pop", "popleft", "clear",
             "remove", "insert", "fill", "put", "itemset", "sort", "resize", "setflags"}
_NP_WRITERS = {"put", "copyto", "place", "putmask", "put_along_axis", "fill_diagonal"}


def ram_writes(source: str) -> list:
    """``(line, what)`` of each write into a :class:`nbtools.disk.slots.RamSlots`' state in a
    module other than slots.py: an assignment (plain, augmented, to a subscript or slice, or
    to an attribute) whose target is ``<x>.ram.<name>`` (``d.ram``, ``self.ram``,
    ``self.disk.ram``), a local alias of a RamSlots (``ram = self.disk.ram``) or of one of its
    arrays (``flags = ram.dirty``, a slice of one), or ``getattr(<ram>, name)``; and each
    in-place call on such an array (``.fill_(``, ``.append(``, ``np.put(arr, ...)``)."""
    tree = ast.parse(source)
    found = []

    def scopes():
        yield tree
        yield from (n for n in ast.walk(tree)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    def own_nodes(scope):       # the scope's nodes, not those of functions nested in it
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.extend(ast.iter_child_nodes(node))

    for scope in scopes():
        nodes = list(own_nodes(scope))
        rams, arrays = set(), set()         # local names of RamSlots, of their arrays

        def is_ram(e):
            return (isinstance(e, ast.Attribute) and e.attr == "ram") or \
                (isinstance(e, ast.Name) and e.id in rams)

        def is_array(e):        # a RamSlots' attribute (or a view of one: a slice)
            if isinstance(e, ast.Attribute) and is_ram(e.value):
                return True
            if isinstance(e, ast.Call) and ast.unparse(e.func) == "getattr" and e.args and \
                    is_ram(e.args[0]):
                return True
            if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Slice):
                return is_array(e.value)
            return isinstance(e, ast.Name) and e.id in arrays

        def pairs(target, value):
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and \
                    len(target.elts) == len(value.elts):
                for t, v in zip(target.elts, value.elts):
                    yield from pairs(t, v)
            else:
                yield target, value

        for _ in range(2):                  # (an alias of an alias)
            for node in nodes:
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        for t, v in pairs(target, node.value):
                            if isinstance(t, ast.Name):
                                if is_ram(v):
                                    rams.add(t.id)
                                elif is_array(v):
                                    arrays.add(t.id)

        def written(t):
            if isinstance(t, (ast.Tuple, ast.List)):
                return any(written(e) for e in t.elts)
            if isinstance(t, ast.Starred):
                return written(t.value)
            if isinstance(t, ast.Subscript):
                return is_array(t.value)
            return isinstance(t, ast.Attribute) and is_ram(t.value)

        for node in nodes:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if written(t):
                    found.append((node.lineno, ast.unparse(t)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if (name in _MUTATORS or (name.endswith("_") and not name.startswith("_"))) \
                        and is_array(node.func.value):
                    found.append((node.lineno, ast.unparse(node.func) + "(...)"))
                elif name in _NP_WRITERS and ast.unparse(node.func.value) in ("np", "numpy") \
                        and node.args and is_array(node.args[0]):
                    found.append((node.lineno, ast.unparse(node.func) + "(...)"))
    return sorted(found)


def test_the_check_finds_writes_into_ram_slots():
    source = ("def f(self, d):\n"
              "    d.ram.ref[s] = True\n"                         # 2
              "    ram = self.disk.ram\n"
              "    ram.dirty[s] = ram.ref[s] = False\n"           # 4 (twice)
              "    flags = ram.ahead\n"
              "    flags[s] = True\n"                             # 6
              "    view = ram.slot_of[2:5]\n"
              "    view[0] = 1\n"                                 # 8
              "    copy = ram.slot_of[ids]\n"
              "    copy[0] = 1\n"                                 # (a copy: not counted)
              "    self.ram.free_slots.append(s)\n"               # 11
              "    getattr(d.ram, 'loading')[s] = False\n"        # 12
              "    np.put(ram.busy, s, 0)\n"                      # 13
              "    ram.counts['evicted'] += 1\n"                  # 14
              "    d.ram.slab.tensor.fill_(0)\n"                  # (the slab's tensor: not seen)
              "    ram.hand = 0\n"                                # 16
              "    ram.placed(ids, s)\n"                          # (a verb)
              "    x = d.ram.dirty[s]\n"
              "def g(ram):\n"
              "    ram[s] = 1\n")                                 # (not a RamSlots)
    assert [line for line, _ in ram_writes(source)] == [2, 4, 4, 6, 8, 11, 12, 13, 14, 16]


# writes into RamSlots' state left outside slots.py (issue 58's target: 5 at most)
RAM_WRITES_LEFT = 0


def test_disk_writes_ram_slots_only_through_its_verbs():
    found = [f"{path.name}:{line}: {what}" for path in sorted(DISK.glob("*.py"))
             if path.name != "slots.py" for line, what in ram_writes(path.read_text())]
    assert len(found) <= RAM_WRITES_LEFT, \
        "writes into RamSlots' arrays outside nbtools/disk/slots.py (call one of its verbs, " \
        "or add one):\n" + "\n".join(found)


# --- the checkpoint reaches a table's rows only through its tier's whole-table face ---------
CHECKPOINT = TESTS.parent / "nbtools" / "checkpoint"


def table_reaches(source: str) -> list:
    """``(line, what)`` of each reach past a table's tier in a module: an attribute ``disk``
    (a table's DiskRows), ``file`` (a table's file) or ``storage`` (the memory under the tier)."""
    return sorted((node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr in ("disk", "file", "storage"))


def test_table_reaches_are_found():
    source = ("def f(t, d):\n"
              "    d.file.write_range(0, x)\n"        # 2
              "    t.disk.flush()\n"                   # 3
              "    rows = t.storage.tensor\n"          # 4
              "    face = t.rows.whole()\n"            # (the tier: what the checkpoint uses)
              "    face.write_bytes(0, x)\n")
    assert [line for line, _ in table_reaches(source)] == [2, 3, 4]


def test_the_checkpoint_reaches_rows_only_through_the_tier():
    found = [f"{path.name}:{line}: {what}" for path in sorted(CHECKPOINT.glob("*.py"))
             for line, what in table_reaches(path.read_text())]
    assert not found, "nbtools/checkpoint/ reaches past a table's tier (use table.rows.whole()):" \
        "\n" + "\n".join(found)


# --- the tier answers what the rest asks: no branch on whether a table has a disk -----------
NBTOOLS = TESTS.parent / "nbtools"


def disk_branches(source: str) -> list:
    """``(line, what)`` of each comparison of an attribute ``disk`` with None (``table.disk is
    None``, ``t.rows.disk is not None``): a branch on which kind of tier holds the rows, which
    the tier should answer itself (``in_memory``, ``own_cache``, ``cache_cost``, ...)."""
    return sorted((node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                  and node.left.attr == "disk" and len(node.ops) == 1
                  and isinstance(node.ops[0], (ast.Is, ast.IsNot))
                  and isinstance(node.comparators[0], ast.Constant)
                  and node.comparators[0].value is None)


def test_disk_branches_are_found():
    source = ("if table.disk is None:\n    pass\n"          # 1
              "x = t.rows.disk is not None\n"               # 3
              "if disk is None:\n    pass\n"                # (a local: not a table's attribute)
              "if table.disk == 3:\n    pass\n")
    assert [line for line, _ in disk_branches(source)] == [1, 3]


def test_no_branch_on_a_tables_disk_outside_the_disk_wing():
    found = [f"{path.relative_to(NBTOOLS)}:{line}: {what}" for path in sorted(NBTOOLS.rglob("*.py"))
             if "disk" not in path.relative_to(NBTOOLS).parts[:1]
             for line, what in disk_branches(path.read_text())]
    assert not found, "branches on a table's disk outside nbtools/disk/ (ask the tier: " \
        "in_memory, own_cache, cache_cost, warm_rows):\n" + "\n".join(found)


# --- the table holds its tier and lookups; what is not its own job lives beside it ----------
TABLE_LINES_MAX = 450


def test_tables_module_stays_small():
    lines = len((NBTOOLS / "tables.py").read_text().splitlines())
    assert lines <= TABLE_LINES_MAX, \
        f"nbtools/tables.py has {lines} lines (at most {TABLE_LINES_MAX}): what is not the " \
        "table's own job goes to its tier, its lookups or nbtools.placement"


def test_the_table_holds_no_second_handle_on_its_rows():
    # one tier (``_rows``) reaches the memory and says how its rows are laid out: no
    # ``self._host`` / ``self._disk`` / ``self._layout`` / ``self._state_names`` beside it
    source = (NBTOOLS / "tables.py").read_text()
    handles = ("_host", "_disk", "_storage", "_layout", "_state_names")
    found = sorted({node.attr for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and node.attr in handles})
    assert not found, f"the table keeps handles on its memory beside its tier: {found}"


# --- the parts below the table take what they need, not the table ---------------------------

def _table_takers(source: str) -> list:
    """Functions (and methods) whose first parameter after ``self`` is named ``table``."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if names[:1] == ["self"]:
                names = names[1:]
            if names[:1] == ["table"]:
                found.append(node.name)
    return found


def test_table_takers_are_found():
    source = ("def a(table, x): pass\nclass C:\n    def b(self, table): pass\n"
              "    def c(self, rows, table): pass\ndef d(owner): pass\n")
    assert _table_takers(source) == ["a", "b"]


def test_few_parts_take_the_whole_table():
    """store/, disk/, engine/ and placement.py: at most five functions take the table (the
    table's lookups and its cache's attach and warm, and placement's two regrows)."""
    files = [p for wing in ("store", "disk", "engine") for p in (NBTOOLS / wing).glob("*.py")]
    files.append(NBTOOLS / "placement.py")
    takers = [f"{p.relative_to(NBTOOLS)}: {name}" for p in sorted(files)
              for name in _table_takers(p.read_text())]
    assert len(takers) <= 5, "\n".join(takers)


# --- the table's methods are its own, not forwards for its parts to call back ----------------
FORWARDS_MAX = 8


def _forwards(source: str, cls: str) -> list:
    """Methods of ``cls`` whose body (past a docstring) is one call on another object the
    instance holds: ``return self.a.b(...)`` or ``self.a.b(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for f in node.body:
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = [s for s in f.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
                continue
            call = body[0].value
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
                continue
            owner = call.func.value             # self.a (or deeper): another object's verb
            if isinstance(owner, ast.Attribute) and ast.unparse(owner).startswith("self."):
                found.append(f.name)
    return found


def test_forwards_are_found():
    source = ("class T:\n    def a(self):\n        'doc'\n        return self.x.f(1)\n"
              "    def b(self):\n        self.x.y.g()\n    def c(self):\n        return self.h()\n"
              "    def d(self):\n        y = 1\n        return self.x.f(y)\n"
              "    def e(self):\n        return f(self)\n")
    assert _forwards(source, "T") == ["a", "b"]


def test_the_table_has_few_one_line_forwards():
    found = _forwards((NBTOOLS / "tables.py").read_text(), "OffloadedEmbedding")
    assert 0 < len(found) <= FORWARDS_MAX, found


# --- the code speaks of itself, not of the lab's history --------------------------------------
_HISTORY = re.compile(r"git show|\b[Ss]ession \d|\b[Ii]ssue #?\d|\b(?:first|second|third|"
                      r"fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|next) sitting\b")


def history_references(source: str) -> list:
    """``(line, text)`` of each reference to the project's history in ``source``: a commit
    to look up (``git show``), a numbered session or issue, a sitting."""
    return [(i, line.strip()) for i, line in enumerate(source.splitlines(), 1)
            if _HISTORY.search(line)]


def test_history_references_are_found():
    source = ("x = 1  # see git show abc:f.py\n# Session 12 found\n# a Colab session\n"
              "# (issue 58)\n# requests are issued\n# the rows sitting in the file\n"
              "# the sixth sitting\n")
    assert [line for line, _ in history_references(source)] == [1, 2, 4, 7]


def test_nbtools_speaks_of_itself_not_its_history():
    found = [f"{p.relative_to(NBTOOLS)}:{line}: {text}" for p in sorted(NBTOOLS.rglob("*.py"))
             for line, text in history_references(p.read_text())]
    assert not found, "\n".join(found)
