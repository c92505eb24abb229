"""``scripts/device_check.sh``: the prepared GPU check, run here as its CPU dry run.

The dry run is the same script and the same steps with ``cpu`` for ``cuda`` and tiny sizes, so
CI keeps the check working until a GPU runs it (docs/compatibility.md, "Devices"). The second
test breaks steps on purpose (``FLATPOOL_DEVICE_CHECK_INJECT``): a failing step and a hanging
one are recorded, the time budget stops the run, and the results are still written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_check.sh"
STEPS = ["environment", "tests", "adopt", "optim", "fused", "snapshot", "demo"]


def _run(out: Path, *args: str, inject: str = "") -> tuple[subprocess.CompletedProcess[str], Any]:
    env = dict(os.environ, FLATPOOL_DEVICE_PYTHON=sys.executable)
    env.pop("OUT", None)
    if inject:
        env["FLATPOOL_DEVICE_CHECK_INJECT"] = inject
    r = subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], env=env,
                       capture_output=True, text=True, timeout=300)
    data = json.loads((out / "device-results.json").read_text())
    return r, data


def test_dry_run_runs_every_step_on_cpu_and_writes_the_results(tmp_path: Path) -> None:
    r, data = _run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert data["mode"] == "dry-run" and data["verdict"] == "passed" and data["finished"]
    steps = {s["name"]: s for s in data["steps"]}
    assert list(steps) == STEPS
    assert all(s["status"] == "passed" for s in steps.values()), r.stdout
    assert data["seconds"] < 180
    env = steps["environment"]["figures"]
    assert env["torch"] and env["device"] == "cpu (dry run)"
    # (a) the device marker selects the accelerator tests, and on CPU each of them skips
    tests = steps["tests"]["figures"]
    assert tests["selected"] >= 4 and tests["skipped"] == tests["selected"]
    # (b) what CPU cannot show is recorded as skipped, with the reason, never left out
    adopt = {c["name"]: c for c in steps["adopt"]["checks"]}
    assert adopt["report.all_released (the release proof)"]["ok"] is True
    assert any(c["ok"] is None and "no caching allocator" in c["detail"] for c in adopt.values())
    # (c) every optimizer, size and dtype ran; float32 is bit-identical to foreach=True
    f = steps["optim"]["figures"]
    for opt in ("AdamW", "SGD", "Adam"):
        for n in (10, 40):
            assert f[f"identical/{opt}/{n}/float32"] is True
            assert {f"identical/{opt}/{n}/bfloat16", f"identical/{opt}/{n}/float16"} <= set(f)
            assert f[f"time/{opt}/{n}"]["flat_s"] > 0
    # (f) where a flat fused step is exact: every optimizer and dtype measured, and FUSED_EXACT's
    # claims held (a claim that fails fails the step)
    fu = steps["fused"]["figures"]
    assert {f"fused_exact/cpu/AdamW/{d}" for d in ("float32", "float64", "bfloat16", "float16")} <= set(fu)
    assert fu["fused_exact/cpu/AdamW/bfloat16"] is True and fu["fused_exact/cpu/SGD/float32"] is True
    # (d) the attribution and its picture; (e) the demo judged from its rows
    assert (tmp_path / "device-snapshot.png").stat().st_size > 1000
    assert steps["snapshot"]["figures"]["naive"]["by_class"]["stale"] > 0
    assert steps["demo"]["figures"]["world_size"] == 1
    md = (tmp_path / "device-results.md").read_text()
    assert md.startswith("# flatpool device check: dry run on CPU")
    for title in ("(a) the test suite", "(b) adopt + release", "(c) flat optimizer",
                  "(d) memory snapshot", "(e) the demo", "(f) where a flat fused step"):
        assert title in md
    assert "skipped: allocation history" in md
    assert "verdict: passed" in r.stdout


def test_a_failing_step_and_a_hanging_one_are_recorded_and_the_budget_holds(tmp_path: Path) -> None:
    r, data = _run(tmp_path, "--dry-run", "--only", "adopt,optim,snapshot", "--budget", "11",
                   inject="adopt=raise,optim=hang")
    assert r.returncode == 1, r.stdout + r.stderr
    steps = {s["name"]: s for s in data["steps"]}
    assert steps["adopt"]["status"] == "error" and "injected failure" in steps["adopt"]["error"]
    assert steps["optim"]["status"] == "timed out"  # stopped at the budget, not at its 60 s cap
    assert steps["snapshot"]["status"] == "not run" and "out of time" in steps["snapshot"]["error"]
    assert data["verdict"] == "failed" and data["seconds"] < 20
    md = (tmp_path / "device-results.md").read_text()
    assert "injected failure" in md and "timed out" in md
    assert "step adopt" in (tmp_path / "device-check.log").read_text()
