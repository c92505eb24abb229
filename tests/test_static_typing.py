"""flatpool's public API under ``mypy --strict``: sharding-style usage passes, misuse fails.

The checked modules live in ``tests/typing_usage`` (never imported by pytest). Each
``bad_usage_*.py`` marks its one deliberate misuse with ``# expect: [code]``; the test asserts
mypy reports exactly those codes on exactly those lines. All files go through one mypy run
(cold cache about 20 s) with a cache of its own under ``.mypy_cache/``. Where pyright is
installed (``pip install pyright``; its first run fetches node from npm), the same files also go
through ``pyright`` in strict mode: the good file clean, each bad file flagged on its marked line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
USAGE = Path(__file__).resolve().parent / "typing_usage"
GOOD = USAGE / "good_usage.py"
BAD = sorted(USAGE.glob("bad_usage_*.py"))
ERROR_LINE = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
EXPECT = re.compile(r"#\s*expect:\s*\[(?P<code>[a-z-]+)\]")



@pytest.fixture(scope="module")
def mypy_errors() -> dict[str, set[tuple[int, str]]]:
    """Run mypy once over every usage file; map each file name to its (line, code) errors."""
    pytest.importorskip("mypy")
    files = [GOOD, *BAD]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",  # judge the usage files; flatpool has its own CI run
            "--cache-dir",
            str(REPO / ".mypy_cache" / "typing-usage"),
            "--no-color-output",
            "--no-error-summary",
            *(str(f.relative_to(REPO)) for f in files),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), f"mypy crashed:\n{proc.stdout}\n{proc.stderr}"
    errors: dict[str, set[tuple[int, str]]] = {f.name: set() for f in files}
    for line in proc.stdout.splitlines():
        m = ERROR_LINE.match(line.strip())
        if m:
            errors.setdefault(Path(m["path"]).name, set()).add((int(m["line"]), m["code"]))
        elif ": error:" in line:
            raise AssertionError(f"unparsed mypy error: {line}")
    return errors


def expected_errors(path: Path) -> set[tuple[int, str]]:
    out = set()
    for no, text in enumerate(path.read_text().splitlines(), start=1):
        m = EXPECT.search(text)
        if m:
            out.add((no, m["code"]))
    return out


def test_usage_files_exist() -> None:
    assert GOOD.is_file()
    assert len(BAD) >= 3
    for path in BAD:
        assert len(expected_errors(path)) == 1, f"{path.name} must mark one misuse"


def test_good_usage_passes(mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    assert mypy_errors[GOOD.name] == set()


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_usage_fails(path: Path, mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    assert mypy_errors[path.name] == expected_errors(path)


def _need_pyright() -> None:
    pytest.importorskip("pyright")
    try:
        probe = subprocess.run([sys.executable, "-m", "pyright", "--version"],
                               capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("pyright did not start within 120 s (it fetches node on first use)")
    if probe.returncode != 0:
        pytest.skip(f"pyright does not run here: {probe.stderr.strip()[-200:]}")


@pytest.fixture(scope="module")
def pyright_error_lines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[int]]:
    """Run pyright (strict) once over every usage file; map each file name to its error lines."""
    _need_pyright()
    config = tmp_path_factory.mktemp("pyright") / "pyrightconfig.json"
    # extraPaths: the checkout itself (an editable install's import hook is opaque to pyright)
    config.write_text(json.dumps({"typeCheckingMode": "strict", "extraPaths": [str(REPO)]}))
    files = [GOOD, *BAD]
    proc = subprocess.run(
        [sys.executable, "-m", "pyright", "-p", str(config), "--pythonpath", sys.executable,
         "--outputjson", *map(str, files)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode in (0, 1), f"pyright crashed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["summary"]["filesAnalyzed"] == len(files), report["summary"]
    errors: dict[str, set[int]] = {f.name: set() for f in files}
    for diag in report["generalDiagnostics"]:
        if diag["severity"] == "error":
            errors[Path(diag["file"]).name].add(diag["range"]["start"]["line"] + 1)
    return errors


def test_good_usage_passes_pyright_strict(pyright_error_lines: dict[str, set[int]]) -> None:
    assert pyright_error_lines[GOOD.name] == set()


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_usage_fails_pyright_strict(path: Path,
                                        pyright_error_lines: dict[str, set[int]]) -> None:
    assert pyright_error_lines[path.name] == {line for line, _ in expected_errors(path)}


def test_pyright_verifytypes_finds_the_package_type_complete(tmp_path: Path) -> None:
    """``pyright --verifytypes flatpool --ignoreexternal`` (torch's own partly unknown types
    left out) on the package as the wheel lays it out: at least 98% of the symbols it counts
    have known types (85% before annotations were added)."""
    _need_pyright()
    site = tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "flatpool", site / "flatpool", ignore=ignore)
    shutil.copytree(REPO / "integrations", site / "flatpool" / "integrations", ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(site),
           # pyright asks the first `python` on PATH for the import roots (torch, attrs)
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    proc = subprocess.run(
        [sys.executable, "-m", "pyright", "--verifytypes", "flatpool", "--ignoreexternal",
         "--outputjson"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    report = json.loads(proc.stdout)
    completeness = report["typeCompleteness"]
    assert completeness["pyTypedPath"].startswith(str(site)), completeness["pyTypedPath"]
    incomplete = [s["name"] for s in completeness["symbols"]
                  if s["isExported"] and (not s["isTypeKnown"] or s.get("isTypeAmbiguous"))]
    assert completeness["completenessScore"] >= 0.98, incomplete[:40]
