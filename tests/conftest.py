import os

from compile_caches import GRAPH_CACHES_OFF

# Compiled-path tests must never be answered by a cache filled by older code (compile_caches.py).
# Before torch is imported: its configs read these variables once, at import.
for _name, _value in GRAPH_CACHES_OFF.items():
    os.environ.setdefault(_name, _value)

# --- nvfp4_inductor.kernels: Triton interpreter on machines without CUDA -----------------
# Must run before anything imports triton: triton.jit reads the interpret setting when a
# kernel is decorated, and nvfp4_inductor.kernels picks its op mode when imported.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end nvfp4_inductor.kernels -----------------------------------------------------------


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from a fresh Dynamo: sizes that another test of the same worker
    compiled (a GroupedMLP of other sizes) would otherwise come back symbolic (automatic
    dynamic shapes), and a site with symbolic expert weights is rejected -- which tests
    then fail depends on how xdist orders them."""
    torch._dynamo.reset()


@pytest.fixture
def use_steps():
    """``use_steps(steps, like="reference", inline=False)``: register, for this test only and as the most
    preferred target, a target that runs the step table `steps` on every device with the
    capabilities the built-in target `like` has on the CPU (so ``like="triton"`` plans its
    fused kernels: the Triton interpreter runs them on CPU tensors). Eager ops, plans and
    fused ops then all run `steps`, chosen through the registry; `inline`: the target's
    ``Target.inline``."""
    from nvfp4_inductor import lowerings

    added = []

    def use(steps, like="reference", inline=False):
        caps = lowerings.get_target(like).probe(torch.device("cpu"))
        assert not isinstance(caps, str), caps
        target = lowerings.Target(f"{like}_under_test", lambda: steps, lambda device: caps,
                                  inline=lambda: inline)
        lowerings.register_target(target)
        added.append(target.name)
        return target

    yield use
    for name in added:
        lowerings.unregister_target(name)


@pytest.fixture
def replace_launches(monkeypatch):
    """``replace_launches(make)``: for this test only, every kernel module's ``launch`` (the
    one place a kernel of ours is launched) becomes ``make(launch)``: a recorder, a counter
    around the real launch, or a stub (the allocations without the kernels)."""
    import importlib
    import pkgutil

    from nvfp4_inductor import kernels

    def replace(make):
        # every module imported before any is patched: one first imported in between would
        # bind the replaced launch as its own, wrap it again, and keep it after the restore
        modules = [importlib.import_module(f"{kernels.__name__}.{info.name}")
                   for info in pkgutil.iter_modules(kernels.__path__)]
        for module in modules:
            if hasattr(module, "launch"):
                monkeypatch.setattr(module, "launch", make(module.launch))

    return replace
