"""The README's main command: the demo on 2 gloo ranks (tiny sizes), with its memory pictures."""

from __future__ import annotations

from pathlib import Path

import pytest

from flatpool.integrations.hsdp import demo


def test_demo_passes_and_draws_the_seed_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # --png draws with it (flatpool's 'viz' extra)
    out = tmp_path / "pictures"
    code = demo.main(["--hidden", "32", "--ffn", "64", "--steps", "2", "--png", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    for mode in demo.MODES:
        assert text.count(f"  {mode}") == 2, text  # one row per rank
    assert "BUG (as reported)" in text and "FAIL" not in text
    for rank in (0, 1):
        png = out / f"rank{rank}.png"
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
