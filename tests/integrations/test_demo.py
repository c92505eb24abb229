"""The README's main command: the demo on 2 gloo ranks (tiny sizes), with its memory pictures,
its progress lines, for both clients, and the HyperParallel client under torchrun."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from examples import demo, demo_hyperparallel
from flatpool.memory._viz import COLOURS
from torchrun_jobs import run_torchrun

REPO = Path(__file__).resolve().parents[2]

HP_MODES = [m for m, _, _ in demo_hyperparallel.modes(4, 4, "cpu")]


def assert_pictures(out: Path, stdout: str) -> None:
    paths = [out / f"rank{rank}.png" for rank in (0, 1)]
    for png in paths:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"memory pictures: {paths[0]}, {paths[1]}" in stdout


def assert_progress(stderr: str, modes: list[str], steps: int) -> None:
    """One line per mode and step, from rank 0 only, in order, on stderr."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("progress: ")]
    want = [f"progress: {m}: step {s}/{steps}" for m in modes for s in range(1, steps + 1)]
    got = [ln.split(", loss")[0] for ln in lines if ": step " in ln]
    assert got == want, stderr
    assert lines[0].startswith("progress: starting 2 ranks on cpu (gloo) ("), stderr
    assert all(re.search(r" \(\d+\.\d s\)$", ln) for ln in lines), stderr  # elapsed time


def test_demo_passes_and_draws_the_seed_case(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # --png draws with it (flatpool's 'viz' extra)
    out = tmp_path / "pictures"
    code = demo.main(["--hidden", "32", "--ffn", "64", "--steps", "2", "--png", str(out)])
    text, err = capfd.readouterr()
    assert code == 0, text + err
    for mode in demo.MODES:
        assert text.count(f"  {mode}") == 2, text  # one row per rank
    assert "BUG (as reported)" in text and "FAIL" not in text
    assert "progress:" not in text  # the tables on stdout stay clean
    assert_pictures(out, text)
    assert_progress(err, list(demo.MODES), 2)


def test_hyperparallel_client_draws_and_reports_progress(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--client hyperparallel --png DIR`` writes each rank's picture (it wrote none)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "hp"
    code = demo.main(["--client", "hyperparallel", "--hidden", "32", "--ffn", "64", "--steps",
                      "2", "--png", str(out)])
    text, err = capfd.readouterr()
    assert code == 0, text + err
    for mode in HP_MODES:
        assert text.count(f"  {mode}  ") == 2, text
    assert text.count("BUG (as reported)") == 2 and "FAIL" not in text
    assert_pictures(out, text)
    assert_progress(err, HP_MODES, 2)
    # the shipped group's surviving originals are drawn stale (its two 4-row shards)
    image = pytest.importorskip("matplotlib.image").imread(str(out / "rank0.png"))
    stale = torch.tensor([int(COLOURS["stale"][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    assert int(((torch.tensor(image[..., :3]) - stale).abs().max(-1).values < 0.01).sum()) > 3000


def test_hyperparallel_client_runs_as_one_torchrun_job() -> None:
    """Under torchrun each process is one rank of one job: one header, each rank's table once
    (each rank used to start its own 2-rank job, so every table came twice)."""
    proc = run_torchrun(["-m", "examples.demo", "--client", "hyperparallel",
                         "--hidden", "32", "--ffn", "64", "--steps", "1"], cwd=REPO)
    out = proc.stdout
    report = f"exit code {proc.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert out.count("flatpool demo, HyperParallel simulation: 2 ranks") == 1, report
    assert out.count("rank 0:") == 1 and out.count("rank 1:") == 1, report
    assert out.count("BUG (as reported)") == 2 and "FAIL" not in out, report
    assert "progress: starting" not in proc.stderr, report  # torchrun started the ranks
    assert proc.stderr.count("progress: no fusion: step 1/1") == 1, report  # rank 0 only


def test_optim_flat_adds_the_optimizer_storage_rows(capfd: pytest.CaptureFixture[str]) -> None:
    """``--optim flat``: after the fusion tables, each rank's storages per kind (parameters,
    gradients, AdamW state) with no pools, parameters pooled and all pooled (gradient pools
    shown as pools), what pooling saves, and the losses identical."""
    code = demo.main(["--hidden", "32", "--ffn", "64", "--steps", "2", "--optim", "flat"])
    out = capfd.readouterr().out
    assert code == 0, out
    grads = re.findall(r"^  gradients\s+(\d+) storages, .*?  (\d+) storages, .*?  (\d+) pools, ",
                       out, re.M)
    state = re.findall(r"^  optimizer state\s+(\d+) storages, .*?  (\d+) storages, .*?  "
                       r"(\d+) pools, .*?  (\d+) of (\d+) storages", out, re.M)
    assert len(grads) == len(state) == 2, out  # one table per rank
    for (g0, g1, g2), (s0, s1, s2, saved, of) in zip(grads, state):
        assert g0 == g1 == g2 and int(s2) == 3 * int(g2)  # one pool per kind per group
        assert s0 == s1 == of and int(saved) == int(s0) - int(s2) > 0
    assert out.count("bit-identical training") == 2 and "DIFFER" not in out


def test_one_rank_says_the_group_is_not_fused_by_design(capfd: pytest.CaptureFixture[str]) -> None:
    """At shard world size 1 ``fuse_fully_sharded`` leaves the group unfused on purpose; the
    demo said FAIL for that row (and exited 1), it says why and passes."""
    code = demo.main(["--world-size", "1", "--hidden", "32", "--ffn", "64", "--steps", "1"])
    text, err = capfd.readouterr()
    assert code == 0, text + err
    row = next(line for line in text.splitlines() if line.strip().startswith("flatpool adopt"))
    assert "not fused, by design: shard world size is 1" in row and "FAIL" not in text
    assert re.search(r"meta init .* ok$", text, re.M), text
