"""Question: does the cudnn target (lowerings/cudnn.py) do on a Blackwell GPU what its CPU
simulator says it does, and is it faster? One command for a user with an SM100 GPU and
``pip install 'nvfp4_inductor[cudnn]'``:

    python benchmarks/blackwell_check.py [--shapes S1 S2] [--skip-timing]

Checks, in order, each a row of the verdict table:
  1. (any machine) the cudnn step table over the CPU simulator: compiled == eager bitwise
     with the fused kernels off and on (the CI tests, repeated here);
  2. (SM10x + frontend) each wired step on the real wrappers against the same step over the
     simulator (CPU) and against the reference target's unfused steps, on small shapes;
  3. (SM10x + frontend) a compiled training step on the real target: compiled == eager
     bitwise, recompute on and off, with the fused kernels off and on (the eager chain runs
     the plan's fused kernels too: docs/numerics.md 5.3);
  4. (SM10x + frontend) forward + backward time at S1 / S2 (benchmarks/grouped_mlp.py
     shapes, srelu) for BF16, the Triton target, and the cudnn target unfused and fused.
Tolerance for "real vs simulator": relative L2 <= 2^-6 per output (the simulator's torch
tanh / sigmoid are exact where the kernels' are approximate, and sums run in another order).

On any other machine it says why the Blackwell checks are skipped and exits 0 after the
checks it can do. Nothing here has run on an SM100 GPU yet (none was lent).
"""

from __future__ import annotations

import argparse
import sys

import torch

import nvfp4_inductor as nv
from nvfp4_inductor import lowerings, numerics
from nvfp4_inductor.inspection import format_table
from nvfp4_inductor.lowerings import cudnn as cd
from nvfp4_inductor.lowerings.cudnn_target import CUDNN, check_target
from nvfp4_inductor.lowerings.reference import STEPS as REFERENCE
from nvfp4_inductor.testing import cudnn_sim, simulated_target
from nvfp4_inductor.recipe import QuantizeOptions
from nvfp4_inductor.tensor import Operand

ROWS: list[list[str]] = []
REL_TOL = 2 ** -6  # the simulator tests' tolerance for one bf16 rounding moved (cudnn_sim docstring)


def verdict(check: str, ok, detail: str) -> None:
    ROWS.append([check, {True: "PASS", False: "FAIL", None: "skipped"}[ok], detail])
    print(f"[{ROWS[-1][1]}] {check}: {detail}", flush=True)


def small_model(device, activation="srelu"):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(3, 128, 256, activation, device=device)
    x = torch.randn(600, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    sizes = torch.tensor([100, 0, 500], device=device)
    return mlp, (x, sizes, torch.rand(600, device=device, requires_grad=True))


def check_simulated() -> None:
    for fused in (False, True):
        mlp, args = small_model("cpu")
        with lowerings.registered(simulated_target(fused=fused)):
            report = nv.compare(mlp, backend=nv.backend(compiler="aot_eager"))(*args)
        verdict(f"simulated cudnn step (fused={fused}), compiled == eager (CPU)", report.bitwise,
                "bitwise" if report.bitwise else str(report))


def rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def on(device, args) -> tuple:
    """A GEMM step's arguments (two operands, then sizes or offsets) on `device`."""
    a, b, sizes = args
    return Operand(*(t.to(device) for t in a)), Operand(*(t.to(device) for t in b)), sizes.to(device)


def check_steps(device) -> None:
    """Each wired step: real wrappers (device) vs the simulator (CPU) vs the reference."""
    real = cd.make_steps(__import__("cudnn"), REFERENCE)
    sim = cd.make_steps(cudnn_sim, REFERENCE)
    torch.manual_seed(0)
    sizes = torch.tensor([100, 0, 300, 256])
    x = torch.randn(int(sizes.sum()), 128, dtype=torch.bfloat16)
    xq = numerics.group_quantize_torch(x, sizes)
    wq = numerics.quantize_weights_torch(torch.randn(4, 256, 128, dtype=torch.bfloat16))
    cpu = (xq.rowwise(), wq.rowwise(), sizes)
    dev = on(device, cpu)
    probs = torch.rand(x.shape[0])

    def row(name, got, simulated, reference=None):
        r_sim = rel(got, simulated)
        detail = f"bitwise vs sim: {torch.equal(got.cpu(), simulated)}, rel vs sim {r_sim:.2e}"
        if reference is not None:
            detail += f", rel vs reference {rel(got, reference):.2e}"
        verdict(name, r_sim <= REL_TOL, detail)

    row(f"{cd.GEMM}: grouped GEMM", real.grouped_gemm(*dev), sim.grouped_gemm(*cpu), REFERENCE.grouped_gemm(*cpu))
    xc = numerics.group_quantize_torch(x, sizes, rowwise=False, columnwise=True)
    gc = numerics.group_quantize_torch(torch.randn(x.shape[0], 256, dtype=torch.bfloat16), sizes, rowwise=False,
                                       columnwise=True)
    wcpu = (gc.columnwise(), xc.columnwise(), xc.columnwise_offsets)
    row(f"{cd.WGRAD}: grouped wgrad", real.grouped_gemm_wgrad(*on(device, wcpu)),
        sim.grouped_gemm_wgrad(*wcpu), REFERENCE.grouped_gemm_wgrad(*wcpu))
    c_ref = REFERENCE.grouped_gemm(*cpu)
    for act, clamp in (("srelu", None), ("tanh_srelu", 3.0), ("swiglu", None)):
        for want in ((False,) if act == "tanh_srelu" else (False, True)):
            name = cd.FC1_HADAMARD if want else cd.fc1_wrapper(act, False)
            unsigned = QuantizeOptions(rowwise=True, columnwise=True, rht=True, sign_mask=0)
            got = real.fc1_act_amax(*dev, probs.to(device), act, clamp, unsigned, want_amax=want)
            ref = sim.fc1_act_amax(*cpu, probs, act, clamp, unsigned, want_amax=want)
            row(f"{name} ({act}): C", got[0], ref[0], c_ref)
            row(f"{name} ({act}): D", got[1], ref[1], REFERENCE.activation_forward(c_ref, probs, act, clamp))
            if want:
                row(f"{name} ({act}): amax", got[2], ref[2])
                row(f"{name} ({act}): post-RHT amax (unsigned)", got[3], ref[3])
        c = torch.randn(x.shape[0], 512 if act == "swiglu" else 256, dtype=torch.bfloat16)
        got = real.fc2_dgrad_act(*dev, c.to(device), probs.to(device), act, clamp, regenerate=True)
        ref = sim.fc2_dgrad_act(*cpu, c, probs, act, clamp, regenerate=True)
        for i, what in enumerate(("dC", "dprob", "regenerated D")):
            row(f"{cd.dgrad_wrapper(act)} ({act}): {what}", got[i], ref[i])


def check_compiled(device) -> None:
    for fused in (False, True):
        mlp, args = small_model(device)
        with lowerings.registered(check_target(fused=fused)):
            [site] = nv.explain(mlp)(*args).sites
            if site.target != "cudnn_check":
                verdict(f"compiled step on cudnn (fused={fused})", False, f"not planned on cudnn: {site.reason}")
                continue
            on = nv.compare(mlp)(*args)
            off = nv.compare(mlp, backend=nv.backend(recompute=False))(*args)
        for recompute, report in (("on", on), ("off", off)):
            verdict(f"compiled == eager on cudnn (fused={fused}), recompute {recompute}", report.bitwise,
                    "bitwise" if report.bitwise else str(report))


def time_shapes(device, shapes) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from grouped_mlp import SHAPES, bf16_mlp, measure, routing

    table = []
    for shape in shapes:
        experts, tokens, hidden, ffn, uneven = SHAPES[shape]
        torch.manual_seed(0)
        sizes = routing(experts, tokens, uneven, device)
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
        w1 = (torch.randn(experts, ffn, hidden, device=device) * hidden ** -0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(experts, hidden, ffn, device=device) * ffn ** -0.5).bfloat16().requires_grad_()
        probs = torch.rand(tokens, device=device, requires_grad=True)
        args, grad = (x, w1, w2, sizes, probs), torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)

        def nvfp4(x, w1, w2, sizes, probs):
            return nv.grouped_mlp(x, w1, w2, sizes, probs, activation="srelu")

        base, *_ = measure(torch.compile(bf16_mlp("srelu")), args, grad)
        table.append([shape, "bf16", f"{base:.3f}", "1.00"])
        for name, target in (("triton", None), ("cudnn unfused", check_target(fused=False)),
                             ("cudnn fused", check_target(fused=True))):
            torch._dynamo.reset()
            fn = torch.compile(nvfp4, backend="nvfp4")
            if target is None:
                ms, *_ = measure(fn, args, grad)
            else:
                with lowerings.registered(target):
                    ms, *_ = measure(fn, args, grad)
            table.append([shape, name, f"{ms:.3f}", f"{base / ms:.2f}"])
    print(format_table(["shape", "srelu fwd+bwd", "ms", "speed-up vs bf16"], table))
    verdict("timing", None, "see the table above")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["S1", "S2"])
    parser.add_argument("--skip-timing", action="store_true")
    opts = parser.parse_args()

    print(f"torch {torch.__version__}; frontend: {cd.installed_capabilities()}")
    check_simulated()
    device = torch.device("cuda") if torch.cuda.is_available() else None
    capability = torch.cuda.get_device_capability() if device is not None else None
    mismatch = CUDNN.device_mismatch("cuda", capability) if device is not None else "no CUDA device"
    frontend = cd.installed_capabilities()
    if mismatch or isinstance(frontend, str):
        why = mismatch or frontend
        verdict("Blackwell checks (wrappers, compiled step, timing)", None, f"skipped: {why}")
    else:
        print(f"device: {torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]})")
        check_steps(device)
        check_compiled(device)
        if not opts.skip_timing:
            time_shapes(device, opts.shapes)
    print()
    print(format_table(["check", "verdict", "detail"], [[c, v, d.splitlines()[0]] for c, v, d in ROWS]))
    return 1 if any(v == "FAIL" for _, v, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
