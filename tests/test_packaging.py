"""The installed package fits into anyone's environment: one import name, `tracetap`.

Builds the real wheel from this checkout (no network: setuptools comes from the test
extra), installs it into a fresh virtual environment and imports it from a directory
that holds a user's own `storage/` and `proxy/` folders.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ["proxy", "storage", "exporters", "migrations", "viewer", "demo"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy of what git would commit: a stale build/ folder in the checkout
    # would otherwise put files the package list no longer names into the wheel.
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                            cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    # A deprecated license table or classifier makes setuptools warn while building.
    assert "SetuptoolsDeprecationWarning" not in built.stdout + built.stderr
    (path,) = out.glob("tracetap-*.whl")
    return path


def test_the_wheel_installs_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"tracetap"}
    top_level = [n for n in names if n.endswith("top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["tracetap"]


def test_every_source_file_is_in_the_wheel(wheel):
    """A package folder left out of pyproject's list would install a broken tracetap."""
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder in PACKAGE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT).as_posix()
            if f"tracetap/{relative}" not in names:
                missing.append(relative)
    assert missing == []
    assert "tracetap/__init__.py" in names and "tracetap/__main__.py" in names


def test_the_version_has_one_source():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "tracetap.__version__"}
    assert project["project"]["scripts"]["tracetap"] == "tracetap.cli:main"


def see_dependencies(python: Path) -> None:
    """Let ``python``'s environment import this one's packages, after its own.

    Listed as paths in a .pth file, so the .pth files of this environment (an editable
    install of this checkout among them) are not run there: only the wheel provides
    ``tracetap``.
    """
    ours = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))
            and Path(p).is_dir()]
    theirs = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    (Path(theirs) / "test-dependencies.pth").write_text("".join(f"{p}\n" for p in ours))


def test_a_users_own_storage_folder_shadows_nothing(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # The dependencies come from the environment that runs the tests, a virtualenv or the
    # system's Python (`system_site_packages` would see only the base interpreter's); the
    # wheel is the only thing installed.
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    see_dependencies(python)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--ignore-installed", str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    work = tmp_path / "project"
    for name in ("storage", "proxy"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text("raise ImportError('the user\\'s own')\n")
    code = ("import tracetap, tracetap.cli, tracetap.storage.writer, "
            "tracetap.exporters.pipeline, tracetap.viewer.render; "
            "print(tracetap.__version__, tracetap.storage.writer.__file__)")
    imported = subprocess.run([str(python), "-c", code], cwd=work, capture_output=True,
                              text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    version, where = imported.stdout.split()
    assert str(env_dir) in where
    version_line = subprocess.run([str(env_dir / "bin" / "tracetap"), "--version"],
                                  cwd=work, capture_output=True, text=True, timeout=120)
    assert version_line.stdout.strip() == f"tracetap {version}"
