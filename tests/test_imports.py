"""Nothing imports upward and nothing imports in a cycle: every module's imports (lazy ones
too) against the package table of docs/architecture.md, read from the page itself so the
page and the code agree, and the run-time import graph of every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("storage", "exporters", "proxy", "viewer", "demo", "migrations", "analysis")
# The top folder: the version (anyone may read it) and the composed command line.
TOP = "tracetap"
LAYERS = (*PACKAGES, TOP)


def allowed_by_the_page() -> dict[str, set[str]]:
    rows = re.findall(r"^\| `(\w+)/` \|[^|]*\|([^|]*)\|$", _table_section(), flags=re.M)
    allowed = {}
    for package, may_import in rows:
        named = {n for n in re.findall(r"`(\w+)`", may_import) if n in LAYERS}
        allowed[package] = set(LAYERS) - {package} if "everything" in may_import else named
    return allowed


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST, run_time_only: bool):
    todo = [tree]
    while todo:
        node = todo.pop()
        if run_time_only and _type_checking(node):
            todo += node.orelse  # the `if TYPE_CHECKING:` body is never run
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo += ast.iter_child_nodes(node)


def imported_names(path: Path, run_time_only: bool = False) -> list[str]:
    """Every module name `path` imports, lazy imports included, as written (as
    `package.name` for `from package import name`, which may be a module or not)."""
    names = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), run_time_only):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        else:
            assert node.level == 0, f"{path}: relative import"
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def layer_of(name: str) -> str | None:
    """The package (or the top) a `tracetap.…` name lives in; None for the root's
    `__version__`, which is no package, and for any other library."""
    parts = name.split(".")
    if parts[0] != "tracetap" or len(parts) < 2:
        return None
    if parts[1] in PACKAGES:
        return parts[1]
    return TOP if (ROOT / TOP / f"{parts[1]}.py").exists() else None


def first_party_imports(path: Path) -> set[str]:
    """The tracetap packages (and the top) `path` imports."""
    return {layer_of(name) for name in imported_names(path)} - {None}


def modules() -> dict[str, Path]:
    """Every module of the tree by its installed name."""
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join(parts if layer == TOP else (TOP, *parts))] = path
    return found


def run_time_graph() -> dict[str, set[str]]:
    """module -> the modules it imports when run (lazily too), type-only imports aside."""
    known = modules()
    graph = {}
    for name, path in known.items():
        edges = set()
        for imported in imported_names(path, run_time_only=True):
            # `from a.b import c`: the module a.b.c if there is one, else a.b itself
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            edges.add(imported)
        graph[name] = edges - {"", name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_page_has_a_row_for_every_package():
    allowed = allowed_by_the_page()
    assert set(allowed) == set(LAYERS)
    assert allowed["storage"] == set()
    assert allowed["exporters"] == {"storage"}
    assert allowed[TOP] == set(PACKAGES)
    # The check allows no module more than its package's row; the page says so too.
    assert "No exceptions: the command line is composed at the top" in _table_section()


def _table_section() -> str:
    page = (ROOT / "docs" / "architecture.md").read_text()
    return page.split("## Packages (", 1)[1].split("\n## ", 1)[0]


def test_the_table_has_no_cycle_so_every_import_points_down():
    """No package may import one that may import it back: the top composes, nothing
    imports the top, and the proxy no longer reaches into demo/ or analysis/."""
    assert cycles(allowed_by_the_page()) == []
    assert not any(TOP in others for package, others in allowed_by_the_page().items()
                   if package != TOP)


def test_no_module_imports_a_package_the_table_does_not_allow():
    allowed = allowed_by_the_page()
    wrong = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            ok = allowed[package] | {package}
            wrong += [f"{name} imports {p}" for p in sorted(first_party_imports(path) - ok)]
    assert wrong == []


def test_no_module_imports_itself_back_at_run_time():
    assert cycles(run_time_graph()) == []


def test_the_cycle_check_finds_a_cycle_through_lazy_imports_only(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from tracetap.proxy.call.driver import ModelCall\n"
                      "def f():\n    from tracetap.proxy.server import workers\n")
    run_time = imported_names(module, run_time_only=True)
    assert "tracetap.proxy.server.workers" in run_time
    assert "tracetap.proxy.call.driver.ModelCall" not in run_time
    assert "tracetap.proxy.call.driver.ModelCall" in imported_names(module)


def test_the_top_is_told_apart_from_the_version():
    assert layer_of("tracetap.cli") == TOP
    assert layer_of("tracetap.__version__") is None
    assert layer_of("tracetap.proxy.server.workers") == "proxy"


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tracetap.proxy import cli\n"
                      "    import tracetap.storage.engine\n    from tracetap import demo\n")
    assert first_party_imports(module) == {"proxy", "storage", "demo"}


def test_code_imports_the_installed_names_never_the_bare_folders():
    """Installed, the folders exist only as tracetap.<folder>: a bare `import proxy` works
    in a checkout and breaks everywhere else."""
    bare = [
        f"{p.relative_to(ROOT)} imports {name}"
        for folder in (*PACKAGES, "tracetap", "tests", "bench")
        for p in sorted((ROOT / folder).rglob("*.py"))
        for name in imported_names(p)
        if name.split(".")[0] in PACKAGES
    ]
    assert bare == []


def test_code_cites_the_architecture_page_not_a_missing_design_file():
    citing = [
        str(p.relative_to(ROOT))
        for package in (*PACKAGES, "tests", "bench")
        for p in (ROOT / package).rglob("*.py")
        if "DESIGN.md" in p.read_text() and p.name != "test_imports.py"
    ]
    assert citing == []


# --- proxy/'s wings ---------------------------------------------------------------------
PROXY = ROOT / "proxy"
# Imports for annotations only that point up a wing: the overlay review hook reads the
# call it reviews (its docstring says so); the rest are lower wings still handed the whole
# call, each pinned here so that no new one creeps in.
TYPE_ONLY_UP = {
    ("overlays", "call"), ("overlays", "runtime"),
}


def wings() -> dict[str, set[str]]:
    """wing -> the wings its __init__ docstring says it may import."""
    found = {}
    for init in sorted(PROXY.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        may = re.search(r"^May import: (.*?)(?:\.$|\.\n)", doc, flags=re.M | re.S)
        assert may, f"{init.relative_to(ROOT)}: no 'May import:' line"
        found[init.parent.name] = set(re.findall(r"`(\w+)`", may.group(1)))
    return found


def wing_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["tracetap", "proxy"] or len(parts) < 3:
        return None
    return parts[2] if (PROXY / parts[2]).is_dir() else None


def test_proxy_top_holds_wings_and_nothing_else():
    top = sorted(p.name for p in PROXY.iterdir() if p.name != "__pycache__")
    assert [p for p in top if p.endswith(".py")] == ["__init__.py"]
    assert len(top) <= 12
    for wing in wings():
        doc = ast.get_docstring(ast.parse((PROXY / wing / "__init__.py").read_text()))
        owned = {p.stem for p in (PROXY / wing).glob("*.py")} - {"__init__"}
        owned |= {p.name for p in (PROXY / wing).iterdir() if (p / "__init__.py").exists()}
        said = re.search(r"^Owns: (.*?)\.$", doc, flags=re.M | re.S)
        assert said, f"proxy/{wing}: no 'Owns:' line"
        named = {n.rstrip("/") for n in re.findall(r"`([\w/]+)`", said.group(1))}
        assert named == owned, f"proxy/{wing}/__init__.py's Owns line: {named ^ owned}"


def test_the_wings_form_no_cycle():
    assert set(wings()) == {p.parent.name for p in PROXY.glob("*/__init__.py")}
    assert cycles(wings()) == []
    assert all(set(may) <= set(wings()) for may in wings().values())


def wing_imports_not_allowed(path: Path, wing: str, may: set[str]) -> list[str]:
    """What a module of `wing` imports that its wing may not: run-time imports (lazy ones
    too) only down; imports for annotations only up where TYPE_ONLY_UP pins them."""
    run_time = {wing_of(n) for n in imported_names(path, run_time_only=True)} - {None}
    every = {wing_of(n) for n in imported_names(path)} - {None}
    wrong = [f"imports {other}" for other in sorted(run_time - may - {wing})]
    return wrong + [f"imports {other} (for annotations)"
                    for other in sorted(every - run_time - may - {wing})
                    if (wing, other) not in TYPE_ONLY_UP]


def test_each_wing_imports_only_the_wings_it_may():
    may = wings()
    wrong = []
    for path in sorted(PROXY.rglob("*.py")):
        parts = path.relative_to(PROXY).parts
        if len(parts) >= 2:
            wrong += [f"{path.relative_to(ROOT)} {w}"
                      for w in wing_imports_not_allowed(path, parts[0], may[parts[0]])]
    assert wrong == []


def test_the_wing_check_sees_upward_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from tracetap.proxy.runtime.state import ProxyState\n"
                      "def f():\n    from tracetap.proxy.call import driver\n")
    assert wing_imports_not_allowed(module, "http", set()) == [
        "imports call", "imports runtime (for annotations)"]
    assert wing_imports_not_allowed(module, "overlays", {"http"}) == ["imports call"]
    assert wing_imports_not_allowed(module, "admin", wings()["admin"]) == []


def test_the_architecture_page_lists_the_wings_in_their_order():
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## proxy/'s wings", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)/` \|", section, flags=re.M)
    assert set(listed) == set(wings())
    for i, wing in enumerate(listed):  # each may import only wings listed before it
        assert wings()[wing] <= set(listed[:i]), wing


def test_every_api_package_has_the_same_files():
    apis = PROXY / "apis"
    common = {"__init__.py", "api.py", "capture.py", "conversation.py", "errors.py",
              "request.py"}
    for package in (p for p in apis.iterdir() if (p / "__init__.py").exists()):
        files = {p.name for p in package.glob("*.py")}
        assert common <= files, f"{package.name}: missing {common - files}"


def test_the_registry_lists_every_api_package_and_routing_follows_it():
    from tracetap.proxy.apis.registry import APIS, BY_NAME, TRANSLATABLE
    from tracetap.proxy.apis.routing import Routing, parse_translate

    packages = {p.name for p in (PROXY / "apis").iterdir() if (p / "__init__.py").exists()}
    listed = {api.native().__class__.__module__.split(".")[3] if api.native else None
              for api in APIS} | {api.translation.__name__.split(".")[3]
                                  for api in APIS if api.translation}
    assert listed - {None} == packages
    assert parse_translate("all") == TRANSLATABLE == ("responses", "messages")
    routing = Routing("auto")
    for api in APIS:
        route = routing.route(api.path, "vllm")
        assert route is not None and route.errors is api.errors
        translated = api.translation is not None and "vllm" not in api.native_flavors
        assert (route.translation is not None) == translated, api.name
    assert routing.route("/v1/embeddings", "vllm") is None
    assert BY_NAME["messages"].translation is not None
