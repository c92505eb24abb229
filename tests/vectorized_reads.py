"""Use flatpool's vectorized TensorImpl read in a test, whatever threads earlier tests left.

The read runs only while no other thread can run Python (``torch_compat.sole_thread``). In a
whole-suite run, an earlier test can leave an idle daemon thread for the rest of the session
(multiprocessing's resource sharer, started the first time a tensor is sent to a spawned rank),
which turns the read off for every later test. Here the gate counts only the threads started
after this call: a test that starts one still sees the read turned off, as it must.
"""

from __future__ import annotations

import threading

import pytest

from flatpool import torch_compat as tc


READS = ("vectorized", "per field")
"""The two readers every fast-path test runs on (the fixtures' parameters)."""


def choose_reads(reads: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Switch this test to one reader: ``"per field"`` turns the vectorized read off,
    ``"vectorized"`` makes sure it is in use (:func:`use_vectorized_reads`)."""
    if reads == "per field":
        monkeypatch.setattr(tc, "RAW_LAYOUT", None)
    else:
        use_vectorized_reads(monkeypatch)
    return reads


def use_vectorized_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tc.RAW_LAYOUT is not None, "the probe found no layout"
    present = threading.active_count()
    monkeypatch.setattr(tc, "_sole_thread", lambda: threading.active_count() <= present)
    monkeypatch.setattr(tc, "VECTORIZED_MIN", 1)  # (the groups here are small)
    assert tc.sole_thread()
