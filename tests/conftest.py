import os

# Compiled-path tests must never be answered by a cache filled by older code (PITFALLS.md).
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

# --- nvfp4_inductor.kernels: Triton interpreter on machines without CUDA -----------------
# Must run before anything imports triton: triton.jit reads the interpret setting when a
# kernel is decorated, and nvfp4_inductor.kernels picks its op mode when imported.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end nvfp4_inductor.kernels -----------------------------------------------------------


import pytest  # noqa: E402


@pytest.fixture
def use_lowering(monkeypatch):
    """``use_lowering(lw)``: the fused ops, and the eager GEMM ops their backward calls for
    fc1 (compiler/fused.py ``grouped_mlp_bwd``), run on the lowering `lw`."""
    from nvfp4_inductor import ops
    from nvfp4_inductor.compiler import fused

    def use(lowering):
        for module in (fused, ops):
            monkeypatch.setattr(module, "lowering_for_device", lambda device: lowering)

    return use
