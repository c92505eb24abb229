"""An unsupported torch is refused at import with one clear error (not an AttributeError deep
inside adopt). The release is faked by rewriting ``torch.__version__`` before flatpool imports,
in a fresh interpreter; the real refusal of torch 2.6 is recorded in docs/compatibility.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flatpool.torch_compat import SUPPORTED_BELOW, SUPPORTED_TORCH

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

LO = ".".join(map(str, SUPPORTED_TORCH))
HI = ".".join(map(str, SUPPORTED_BELOW))


def test_an_unsupported_torch_is_refused_at_import_and_a_supported_one_imports() -> None:
    below = f"{SUPPORTED_TORCH[0]}.{SUPPORTED_TORCH[1] - 1}.0+cu124"  # just under the floor
    above = f"{HI}.1"  # the first release not verified
    versions = [below, above, "1.13.1", f"{LO}.1"]
    run = subprocess.run([sys.executable, "-c", _PROBE, *versions],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    results = {v: (kind, typed, msg) for v, kind, typed, msg in json.loads(run.stdout)}
    for version in versions[:3]:
        kind, typed, msg = results[version]
        assert kind == "UnsupportedTorchError" and typed, (version, kind)
        assert f"flatpool supports torch >= {LO}, < {HI}; this is torch {version}." in msg
        assert f"pip install 'torch>={LO},<{HI}'" in msg
    assert results[f"{LO}.1"][0] == "ACCEPTED"


def test_pyproject_states_the_same_range() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"torch>={LO},<{HI}"' in text
    assert f'"torch_npu>={LO},<{HI}"' in text
