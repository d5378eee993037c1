"""The reference target: pure PyTorch on every device, the definition every other target is
tested against. Its step table is ``reference.py``, imported when the target first runs."""

from __future__ import annotations

import torch

from .steps import Steps
from .target import Capabilities, Target


def steps() -> Steps:
    from .reference import STEPS

    return STEPS


def probe(device: torch.device) -> Capabilities:
    return Capabilities(dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}))


REFERENCE = Target("reference", steps, probe)
