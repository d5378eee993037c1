"""The demo and the README as a user reads them: timings of warm steps, and no reference a
user cannot look up (work-tracking ids such as "issue 5" or "run E6")."""

import pathlib
import re
import time

import pytest

from nvfp4_inductor import demo

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_median_seconds_leaves_the_first_call_out():
    calls = []

    def step():  # the first call is slow, as a compiling one is
        calls.append(None)
        time.sleep(0.3 if len(calls) == 1 else 0.0)

    seconds = demo.median_seconds(step, warmup=1, repeat=3)
    assert len(calls) == 4 and seconds < 0.1


@pytest.mark.parametrize("path", ["README.md", "nvfp4_inductor/demo.py"])
def test_no_work_tracking_ids(path):
    text = (ROOT / path).read_text()
    found = re.findall(r"\b(?:issue \d+|runs? [EQP]\d+|run \d+\b)", text)
    assert not found, f"{path} names {found}: cite the command, the date and the log file instead"


def test_accumulation_table_reuses_the_casts_and_matches_bitwise():
    table = demo.accumulation_table("cpu", micro_batches=3)
    row = table.splitlines()[-1].split()
    assert row[:3] == ["3", "2", "4"] and table.rstrip().endswith("bitwise equal"), table
