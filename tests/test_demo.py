"""The demo as a user reads it: timings of warm steps, the accumulation table. (No citation a
reader cannot follow, in the demo or anywhere: tests/test_docs.py.)"""

import time

from nvfp4_inductor import demo


def test_median_seconds_leaves_the_first_call_out():
    calls = []

    def step():  # the first call is slow, as a compiling one is
        calls.append(None)
        time.sleep(0.3 if len(calls) == 1 else 0.0)

    seconds = demo.median_seconds(step, warmup=1, repeat=3)
    assert len(calls) == 4 and seconds < 0.1


def test_accumulation_table_reuses_the_casts_and_matches_bitwise():
    table = demo.accumulation_table("cpu", micro_batches=3)
    row = table.splitlines()[-1].split()
    assert row[:3] == ["3", "2", "4"] and table.rstrip().endswith("bitwise equal"), table
