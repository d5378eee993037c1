"""The triton_fp4 target: the triton target's kernels with its plain grouped GEMMs (fc2 fprop,
the dgrads, the wgrads) on Blackwell's FP4 tensor cores (SM10x-11x), through Triton's
``tl.dot_scaled`` (``kernels/grouped_gemm_fp4.py``); no vendor package. Its step table is
``triton.FP4_STEPS``, imported when the target first runs.

Registered after cudnn and before triton, so it runs on SM10x where the cudnn target does
not: no ``nvidia-cudnn-frontend``, the backend option ``cudnn="off"``, or cudnn's self-check
failed. Its probe is the triton target's, then the self-check (``fp4_self_check.py``) on the
device the first time a plan asks, once per machine and software stack (the verdict is
cached on disk): a failed check refuses the target, so the triton target (bf16-operand
GEMMs) runs. ``self_checked_fp4_target`` builds the same target over any step table
(``nvfp4_inductor.testing``: the kernels under the Triton interpreter, or a wrong stand-in,
on a faked SM10x).
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from . import fp4_self_check, self_check, triton_target
from .steps import Steps
from .target import Capabilities, Target


def self_checked_fp4_target(name: str, steps: Callable[[], Steps],
                            stack: Callable[[torch.device], self_check.Stack], **where) -> Target:
    """The target over the step table `steps()`: its probe is the triton target's, then the
    FP4 self-check of that table on the site's device for `stack(device)`; `describe` says
    which GEMMs run on which tensor cores and each FP4 kernel's verdict. `where`: ``Target``'s
    device fields."""

    def verdict(device) -> Union[self_check.Verdict, str]:
        device = torch.device(device)
        caps = triton_target.probe(device)
        return caps if isinstance(caps, str) else fp4_self_check.verdict(device, stack(device), steps(), caps)

    def probe(device) -> Union[Capabilities, str]:
        found = verdict(device)
        if isinstance(found, str):
            return found
        if found.refusal:  # every case is basis: a GEMM kernel or the training step
            return f"{name}: its self-check on {found.stack.gpu} ({found.date[:10]}) failed: {found.refusal}"
        return triton_target.probe(device)

    def describe(plan, site, recipe) -> str:
        fp4 = ["fc2 fprop", "fc1 dgrad", "the wgrads"]
        fp4 += [] if plan.fused_fc1 else ["fc1"]
        fp4 += [] if plan.fused_dgrad else ["fc2 dgrad"]
        fused = [what for what, on in (("fc1 + activation", plan.fused_fc1),
                                        ("fc2 dgrad + activation backward", plan.fused_dgrad)) if on]
        text = f"{name}: {', '.join(fp4)} on the FP4 tensor cores (packed operands)"
        if fused:
            text += f"; {' and '.join(fused)} on bf16 tensor cores (deq() operands)"
        found = verdict(site.device)
        if isinstance(found, self_check.Verdict):
            table = steps()
            text += "".join(f"; {table.runs(field)}: {found.says(table.runs(field), None)}"
                            for _, field in fp4_self_check.CASES)
        return text

    return Target(name, steps, probe, describe=describe, inline=triton_target.inline, **where)


def _steps() -> Steps:
    from .triton import FP4_STEPS

    return FP4_STEPS


# SM10x/SM11x: tcgen05's ``kind::mxf4nvf4``. SM12x lowers ``dot_scaled`` to other
# instructions, not checked (kernels/grouped_gemm_fp4.py): refused here.
TRITON_FP4 = self_checked_fp4_target("triton_fp4", _steps, self_check.Stack.of, device_types=("cuda",),
                                     min_capability=(10, 0), max_capability=(11, 99))
