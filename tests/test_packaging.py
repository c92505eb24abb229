"""What ``pip install flatpool`` gets: one ``flatpool`` package, typed, licensed; a full sdist.

The wheel and sdist are built offline through setuptools' PEP 517 hooks (what ``pip wheel`` and
``python -m build`` call), once per module. The quick tests read them and import the installed
wheel from outside the repository; the slow one type-checks a consumer module under
``mypy --strict`` against the installed wheel (cold mypy cache about 20 s).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NAME = "flatpool"

BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]
wheel = build_meta.build_wheel(out)
sdist = build_meta.build_sdist(out)
print("BUILT", wheel, sdist)  # the hooks print their own progress too
"""


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheel, sdist) built from a copy of the working tree: setuptools builds through
    ``build/lib`` and keeps what it finds there, so a checkout's stale ``build/`` (modules since
    moved or renamed) would end up in a wheel built in place."""
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / NAME
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, str(out)], cwd=src, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("BUILT ")]
    wheel_name, sdist_name = line.split()[1:]
    return out / wheel_name, out / sdist_name


@pytest.fixture(scope="module")
def installed(dists: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a fresh target directory (a pure wheel installs by unzipping)."""
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(dists[0]) as zf:
        zf.extractall(target)
    return target


def wheel_names(dists: tuple[Path, Path]) -> list[str]:
    with zipfile.ZipFile(dists[0]) as zf:
        return zf.namelist()


def test_wheel_has_exactly_one_top_level_package(dists: tuple[Path, Path]) -> None:
    tops = {n.split("/", 1)[0] for n in wheel_names(dists)}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and tops - dist_info == {NAME}, sorted(tops)
    names = set(wheel_names(dists))
    for module in ("flatpool/checkpoint.py", "flatpool/integrations/__init__.py",
                   "flatpool/integrations/hsdp/__init__.py", "flatpool/optim/__init__.py",
                   "flatpool/memory/__main__.py"):
        assert module in names, module
    # the demos, the launcher and the HyperParallel simulation are examples, not library
    not_library = [n for n in names if any(part in n for part in (
        "examples", "demo", "launch", "hyperparallel_sim", "naive", "tests/"))]
    assert not_library == [], not_library
    (info,) = dist_info
    top_level = f"{info}/top_level.txt"
    if top_level in names:
        with zipfile.ZipFile(dists[0]) as zf:
            assert zf.read(top_level).decode().split() == [NAME]


def test_wheel_is_typed_and_licensed(dists: tuple[Path, Path]) -> None:
    names = set(wheel_names(dists))
    assert "flatpool/py.typed" in names
    assert "flatpool/integrations/py.typed" in names
    (info,) = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
    licenses = [n for n in names if n.startswith(f"{info}/") and n.endswith("LICENSE")]
    assert licenses, sorted(names)
    with zipfile.ZipFile(dists[0]) as zf:
        text = zf.read(licenses[0]).decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert re.search(r"^License-Expression: Apache-2\.0$", metadata, re.M), metadata[:800]
    assert re.search(r"^License-File: LICENSE$", metadata, re.M)


def test_sdist_carries_tests_docs_and_license(dists: tuple[Path, Path]) -> None:
    with tarfile.open(dists[1]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for path in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "MANIFEST.in",
                 "docs/checkpoints.md", "docs/overview.md", "tests/conftest.py",
                 "tests/test_checkpoint.py", "tests/integrations/hsdp_workers.py",
                 "tests/typing_usage/good_usage.py", "scripts/bootstrap.sh",
                 "examples/launch.py", "examples/demo.py", "examples/hyperparallel_sim/unit.py",
                 "flatpool/checkpoint.py"):
        assert path in names, path
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_installed_wheel_imports_as_one_namespace(installed: Path, tmp_path: Path) -> None:
    probe = ("import flatpool, flatpool.integrations.hsdp as h; "
             "print(flatpool.__file__); print(h.__file__); print(h.fuse_fully_sharded.__module__)")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    flat, hsdp, module = proc.stdout.split()
    assert Path(flat).is_relative_to(installed) and Path(hsdp).is_relative_to(installed)
    assert module == "flatpool.integrations.hsdp.fsdp2"


def wheel_metadata(dists: tuple[Path, Path]) -> str:
    with zipfile.ZipFile(dists[0]) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return zf.read(meta).decode()


def test_one_version_pyproject_wheel_and_dunder_version(dists: tuple[Path, Path],
                                                         installed: Path, tmp_path: Path) -> None:
    declared = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert declared
    (meta_version,) = re.findall(r"^Version: (.+)$", wheel_metadata(dists), re.M)
    assert meta_version == declared[1]
    assert dists[0].name.startswith(f"{NAME}-{meta_version}-")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    proc = subprocess.run([sys.executable, "-c", "import flatpool; print(flatpool.__version__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == meta_version


def test_metadata_classifiers_and_requirements(dists: tuple[Path, Path]) -> None:
    meta = wheel_metadata(dists)
    classifiers = set(re.findall(r"^Classifier: (.+)$", meta, re.M))
    assert "Typing :: Typed" in classifiers
    pythons = sorted(c.rsplit(" ", 1)[1] for c in classifiers
                     if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert pythons == ["3.10", "3.11", "3.12", "3.13"], pythons
    assert re.search(r"^Requires-Python: >=3\.10$", meta, re.M)
    # no public home yet: publish no address rather than a guessed one (pyproject says so)
    assert not re.findall(r"^Project-URL: (.+)$", meta, re.M)
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
    plain = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    assert plain == {"torch", "attrs", "numpy"}, requires


def _declared_closure(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` need, transitively (markers evaluated for
    this interpreter, extras left out)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = metadata.distribution(req.name).metadata["Name"]
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        todo.extend(metadata.distribution(name).requires or [])
    return seen


def test_a_clean_environment_with_the_wheel_imports_without_any_warning(
        dists: tuple[Path, Path], installed: Path, tmp_path: Path) -> None:
    """A fresh venv holding the wheel and only what its metadata declares (linked from this
    environment, so no network): ``import flatpool`` prints nothing. Without numpy declared,
    torch printed "Failed to initialize NumPy" here."""
    from importlib import metadata

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    for entry in installed.iterdir():  # the wheel itself
        (site / entry.name).symlink_to(entry)
    requires = re.findall(r"^Requires-Dist: (.+)$", wheel_metadata(dists), re.M)
    for name in sorted(_declared_closure(requires)):
        dist = metadata.distribution(name)
        root = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            if not (site / top).exists() and (root / top).exists():
                (site / top).symlink_to(root / top)
    probe = ("import flatpool, flatpool.integrations.hsdp, torch\n"
             "flatpool.FlatPool().adopt([torch.nn.Linear(4, 4).weight])\n"
             "print(flatpool.__file__)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run([str(venv / "bin" / "python"), "-W", "default", "-c", probe],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(site), proc.stdout
    assert proc.stderr == "", proc.stderr


CONSUMER = textwrap.dedent('''
    """A project that depends on flatpool, checked against the installed wheel."""
    import torch
    from torch import nn

    from flatpool import DeviceLike, FlatPool, Slice, compact_copy
    from flatpool.integrations.hsdp import FusedModule, fuse_fully_sharded


    def planned(device: DeviceLike) -> Slice:
        pool = FlatPool(device=device)
        return pool.allocate((4, 4), torch.float32)


    def fused(module: nn.Module) -> FusedModule:
        return fuse_fully_sharded(module, alignment=512)


    def saved_copy(t: torch.Tensor) -> torch.Tensor:
        return compact_copy(t)


    nbytes: int = planned(0).nbytes
    wrong: str = planned("cpu")  # expect: [assignment]
''')


def run_mypy(consumer_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}  # mypy takes sys.path entries as site dirs
    env.pop("MYPYPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--no-error-summary",
         "--cache-dir", str(REPO / ".mypy_cache" / "installed-wheel"), "consumer.py"],
        cwd=consumer_dir, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_consumer_type_checks_strictly_against_the_installed_wheel(
    installed: Path, tmp_path: Path
) -> None:
    pytest.importorskip("mypy")
    (tmp_path / "consumer.py").write_text(CONSUMER)
    proc = run_mypy(tmp_path, installed)
    errors = [ln for ln in proc.stdout.splitlines() if ": error:" in ln]
    line = next(i for i, t in enumerate(CONSUMER.splitlines(), 1) if "expect: [assignment]" in t)
    assert len(errors) == 1 and errors[0].startswith(f"consumer.py:{line}: error:"), proc.stdout
    assert "[assignment]" in errors[0]
    # without the py.typed markers the same install is opaque to mypy: the check above is real
    (installed / "flatpool" / "py.typed").unlink()
    (installed / "flatpool" / "integrations" / "py.typed").unlink()
    proc = run_mypy(tmp_path, installed)
    assert "py.typed" in proc.stdout or "import-untyped" in proc.stdout, proc.stdout
