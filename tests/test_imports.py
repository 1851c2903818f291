"""Nothing imports upward: every module's imports (lazy ones too) against the package table
of docs/architecture.md, read from the page itself so the page and the code agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("storage", "exporters", "proxy", "viewer", "demo", "migrations", "analysis")
# The page's one exception, in the paragraph under the table.
EXCEPTIONS = {"proxy/cli.py": {"analysis", "demo"}}


def allowed_by_the_page() -> dict[str, set[str]]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)/` \|[^|]*\|([^|]*)\|$", page, flags=re.M)
    allowed = {}
    for package, may_import in rows:
        named = {n for n in re.findall(r"`(\w+)`", may_import) if n in PACKAGES}
        allowed[package] = set(PACKAGES) if "everything" in may_import else named
    return allowed


def imported_names(path: Path) -> list[str]:
    """Every module name `path` imports, lazy imports included, as written."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module == "tracetap":  # from tracetap import exporters, __version__
                names += [f"tracetap.{alias.name}" for alias in node.names]
            else:
                names.append(node.module)
    return names


def first_party_imports(path: Path) -> set[str]:
    """The tracetap packages `path` imports (the root's `__version__` is no package)."""
    return {name.split(".")[1] for name in imported_names(path)
            if name.startswith("tracetap.")} & set(PACKAGES)


def test_the_page_has_a_row_for_every_package():
    allowed = allowed_by_the_page()
    assert set(allowed) == set(PACKAGES)
    assert allowed["storage"] == set()
    assert allowed["exporters"] == {"storage"}
    page = (ROOT / "docs" / "architecture.md").read_text()
    for module, extra in EXCEPTIONS.items():
        assert f"`{module}` also imports {', '.join(f'`{p}`' for p in sorted(extra))}" in (
            " ".join(page.split())
        )


def test_no_module_imports_a_package_the_table_does_not_allow():
    allowed = allowed_by_the_page()
    wrong = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            ok = allowed[package] | {package} | EXCEPTIONS.get(name, set())
            wrong += [f"{name} imports {p}" for p in sorted(first_party_imports(path) - ok)]
    assert wrong == []


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
