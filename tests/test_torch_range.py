"""The torch range: refused below the floor with one clear error, imported silently on a tested
release, imported with one :class:`UntestedTorchWarning` on a newer one (unless a private API
flatpool needs is missing: then one error naming it). Each case fakes the release by rewriting
``torch.__version__`` (or deleting an API) before flatpool imports, in a fresh interpreter; the
real runs of each tested release are recorded in docs/compatibility.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flatpool._torch_compat import NEWEST_TESTED, SILENCE_ENV, SUPPORTED_TORCH

REPO = Path(__file__).resolve().parents[1]
LO = ".".join(map(str, SUPPORTED_TORCH))
TESTED = ".".join(map(str, NEWEST_TESTED))
NEWER = f"{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}.0"

# One interpreter tries each version in turn: a refused import leaves no flatpool module
# behind, so the next attempt imports afresh; the accepted version goes last.
_PROBE = """
import json, sys, torch
out = []
for version in sys.argv[1:]:
    torch.__version__ = version
    try:
        import flatpool.integrations.hsdp
    except ImportError as e:
        names = [c.__name__ for c in type(e).__mro__]
        out.append([version, names[0], "FlatPoolError" in names, str(e)])
    else:
        out.append([version, "ACCEPTED", False, ""])
print(json.dumps(out))
"""

# A user's script under a faked torch: import (twice, and the integrations), then real work.
_USER = """\
import torch; torch.__version__ = {version!r}{sabotage}
import flatpool
import flatpool.integrations.hsdp
import flatpool
lin = torch.nn.Linear(8, 8)
pool = flatpool.FlatPool()
report = pool.adopt([lin.weight, lin.bias])
assert report.all_released and pool.owns(lin.weight)
print("WORKS")
"""


def _run_user(tmp_path: Path, version: str, sabotage: str = "",
              env: dict[str, str] | None = None) -> tuple[Path, subprocess.CompletedProcess[str]]:
    script = tmp_path / "user_script.py"
    script.write_text(_USER.format(version=version, sabotage=sabotage))
    full_env = {k: v for k, v in os.environ.items() if k != SILENCE_ENV and k != "PYTHONWARNINGS"}
    full_env.update(env or {})
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, env=full_env, cwd=tmp_path)
    return script, run


def test_a_torch_below_the_floor_is_refused_at_import_and_a_tested_one_imports() -> None:
    below = f"{SUPPORTED_TORCH[0]}.{SUPPORTED_TORCH[1] - 1}.0+cu124"  # just under the floor
    floor_rc = f"{LO}.0rc1"  # a pre-release of the floor was not tested either
    versions = [below, "1.13.1", floor_rc, f"{LO}.1"]
    run = subprocess.run([sys.executable, "-W", "error", "-c", _PROBE, *versions],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    results = {v: (kind, typed, msg) for v, kind, typed, msg in json.loads(run.stdout)}
    for version in versions[:3]:
        kind, typed, msg = results[version]
        assert kind == "UnsupportedTorchError" and typed, (version, kind)
        assert f"flatpool supports torch >= {LO}; this is torch {version}." in msg
        assert f"pip install 'torch>={LO}'" in msg
    # -W error: a tested release imports without any warning
    assert results[f"{LO}.1"][0] == "ACCEPTED", results[f"{LO}.1"]


@pytest.mark.parametrize("version", [f"{TESTED}.0", f"{TESTED}.1+cpu"])
def test_the_newest_tested_release_imports_without_a_warning(tmp_path: Path,
                                                             version: str) -> None:
    _, run = _run_user(tmp_path, version)
    assert run.returncode == 0 and run.stdout.strip() == "WORKS", run.stderr
    assert "Warning" not in run.stderr, run.stderr


@pytest.mark.parametrize("version", [NEWER, f"{NEWER}.dev20261201+cpu", "3.0.0"])
def test_a_newer_torch_imports_with_one_warning_at_the_users_import_and_works(
        tmp_path: Path, version: str) -> None:
    script, run = _run_user(tmp_path, version)
    assert run.returncode == 0 and run.stdout.strip() == "WORKS", run.stderr
    warned = [ln for ln in run.stderr.splitlines() if "Warning:" in ln]
    assert len(warned) == 1, run.stderr
    # default filters; attributed to the user's first `import flatpool` (line 2), in the
    # project's own category, saying what was tested and how to silence it
    assert warned[0].startswith(f"{script}:2: UntestedTorchWarning: "), warned
    assert f"tested on torch {LO} to {TESTED}; this is torch {version}." in warned[0]
    assert f"{SILENCE_ENV}=1" in warned[0]


def test_the_environment_variable_silences_the_warning(tmp_path: Path) -> None:
    _, run = _run_user(tmp_path, NEWER, env={SILENCE_ENV: "1"})
    assert run.returncode == 0 and run.stdout.strip() == "WORKS", run.stderr
    assert run.stderr == "", run.stderr


def test_the_warning_is_flatpools_own_category() -> None:
    code = (f"import torch, warnings; torch.__version__ = {NEWER!r}\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import flatpool\n"
            "print([(w.category.__module__, w.category.__qualname__) for w in seen])\n"
            "print(issubclass(flatpool.UntestedTorchWarning, flatpool.FlatPoolWarning))")
    env = {k: v for k, v in os.environ.items() if k != SILENCE_ENV}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == [
        "[('flatpool.errors', 'UntestedTorchWarning')]", "True"], run.stdout


@pytest.mark.parametrize("version", [NEWER, f"{TESTED}.0"])
def test_a_missing_private_api_gives_one_error_naming_it(tmp_path: Path, version: str) -> None:
    # what a future release that dropped an API flatpool needs looks like; checked on a tested
    # release too (a broken install): the probe does not depend on the version number
    sabotage = "; del torch._C._swap_tensor_impl; del torch._C._storage_Use_Count"
    _, run = _run_user(tmp_path, version, sabotage=sabotage)
    assert run.returncode == 1 and "WORKS" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("flatpool._torch_compat.UnsupportedTorchError: "), run.stderr
    assert (f"torch {version} lacks torch._C._storage_Use_Count, torch._C._swap_tensor_impl, "
            f"which flatpool needs (tested on torch {LO} to {TESTED})") in last
    assert "Warning" not in run.stderr and "AttributeError" not in run.stderr, run.stderr
    raised = [ln for ln in run.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception): ", ln)]
    assert raised == [last], run.stderr  # one error, no chained one


def test_every_private_api_the_probe_names_is_used_in_torch_compat() -> None:
    from flatpool._torch_compat import _NEEDED_APIS, missing_apis

    source = (REPO / "flatpool" / "_torch_compat.py").read_text()
    body = source.split("check_supported()  # before the probes", 1)[1]
    for name in _NEEDED_APIS:
        assert name.rsplit(".", 1)[1] in body, f"{name} is probed but not used"
    assert missing_apis() == []
    assert missing_apis(["torch._C.no_such_api", "torch.no_such_module.x"]) == [
        "torch._C.no_such_api", "torch.no_such_module.x"]


def test_pyproject_and_docs_state_the_same_range() -> None:
    text = (REPO / "pyproject.toml").read_text()
    deps = re.findall(r'"(torch(?:_npu)?\b[^"]*)"', text)
    # open-ended: no upper bound, a newer torch warns at import instead of being downgraded
    assert f"torch>={LO}" in deps and f"torch_npu>={LO}" in deps, deps
    # the one upper bound: torch in the npu extra, at the newest torch_npu (which pins torch)
    npu = re.search(r"^npu = \[(.*)\]$", text, re.M)
    assert npu and re.findall(r'"([^"]+)"', npu[1]) == [f"torch_npu>={LO}", "torch<2.15"], npu
    assert [d for d in deps if "<" in d] == ["torch<2.15"], deps
    compat = (REPO / "docs" / "compatibility.md").read_text()
    assert f"**torch {LO} to {TESTED}**" in compat
    # the newest tested release has a passing row in the verified-releases table
    assert re.search(rf"^\| {re.escape(TESTED)}\.\d+ \| 3\.\d+\.\d+ \| PASS \|", compat, re.M)
    assert SILENCE_ENV in compat
    assert "torch_npu 2.14.0 with torch 2.14.0" in compat
