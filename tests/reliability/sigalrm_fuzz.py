"""SIGALRM fuzz: interrupt flatpool operations at random moments, check every outcome.

Run in a subprocess by ``test_sigalrm.py`` (``python -m reliability.sigalrm_fuzz N [SEED]
[--big]`` from the ``tests`` folder). For each round one operation of ``test_interrupts.OPS``
(with ``--big``: of ``BIG_OPS``, big plain batches, some on the threaded copy) runs on a fresh world
while an interval timer fires SIGALRM after a random delay within the operation's duration; the
handler raises :class:`Interrupt` wherever the interpreter is (inside flatpool or not). Each
outcome must be "exactly as before" or "fully done"; a rollback must leave the gc pause and the
signal handlers as they were. Prints one JSON line: landings inside flatpool, outside, and the
inconsistent outcomes (which must be none).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from types import FrameType

import flatpool

from .state import Snapshot
from .scenarios import values_of
from .test_interrupts import BIG_OPS, OPS, Interrupt, Ops, settled

FLATPOOL_DIR = os.path.dirname(os.path.abspath(flatpool.__file__))


def main(target: int, max_rounds: int, seed: int, ops: Ops = OPS) -> dict[str, object]:
    rng = random.Random(seed)
    landed: list[str] = []
    stacks: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        landed.append(frame.f_code.co_filename if frame is not None else "?")
        stacks.append("".join(traceback.format_stack(frame, limit=12)) if frame is not None else "?")
        raise Interrupt("SIGALRM")

    signal.signal(signal.SIGALRM, handler)
    durations: dict[str, float] = {}
    for op, (build, prepare) in ops.items():  # how long each takes, untouched
        w = build()
        t0 = time.perf_counter()
        prepare(w)()
        durations[op] = time.perf_counter() - t0
    inside = outside = rounds = 0
    where: Counter[str] = Counter()
    bad: list[str] = []
    while inside < target and rounds < max_rounds:
        rounds += 1
        op = rng.choice(list(ops))
        build, prepare = ops[op]
        w = build()
        run = prepare(w)
        before = values_of(w)
        snap = Snapshot(w.pools, w.tensors, w.places)
        gc_threshold = gc.get_threshold()
        landed.clear()
        stacks.clear()
        delay = max(1e-6, rng.uniform(0.0, 1.2 * durations[op]))
        try:
            signal.setitimer(signal.ITIMER_REAL, delay)
            try:
                run()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Interrupt:
            pass
        except Exception:  # noqa: BLE001 - any other error is a finding
            bad.append(f"{op}: {traceback.format_exc()[-800:]}")
            continue
        if not landed:
            continue
        if landed[0].startswith(FLATPOOL_DIR):
            inside += 1
            where[os.path.relpath(landed[0], FLATPOOL_DIR)] += 1
        else:
            outside += 1
        try:
            assert gc.get_threshold() == gc_threshold, "the gc pause was not undone"
            assert signal.getsignal(signal.SIGALRM) is handler, "a handler was left installed"
            settled(op, w, before, snap)
        except AssertionError as err:
            bad.append(f"{op} (landed in {landed[0]}): {err}\nwhere the signal landed:\n{stacks[0]}")
    return {"rounds": rounds, "inside": inside, "outside": outside, "inconsistent": bad,
            "where": dict(where.most_common())}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--big"]
    target = int(args[0]) if args else 300
    seed = int(args[1]) if len(args) > 1 else 0
    t0 = time.perf_counter()
    result = main(target, max_rounds=40 * target, seed=seed,
                  ops=BIG_OPS if "--big" in sys.argv else OPS)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
