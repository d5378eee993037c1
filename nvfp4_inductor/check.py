"""``python -m nvfp4_inductor.check``: what runs on this machine, checked here, in one
command (docs/blackwell.md). Prints a verdict table per step and target and writes a JSON to
attach to a bug report:

    python -m nvfp4_inductor.check [--json nvfp4_check.json] [--shapes S1 S2] [--skip-timing]

1. (any machine) the cudnn self-check over the CPU simulator of the frontend's wrappers
   (``lowerings/cudnn_sim.py``, 1.32's contract): every case of ``lowerings/self_check.py``
   and its training step;
2. (CUDA, Triton installed) a training step on the Triton target (bf16-operand GEMMs):
   compiled == eager bitwise;
3. (SM10x, Triton installed) the triton_fp4 target's self-check on this GPU (its FP4
   tensor-core GEMMs, ``lowerings/fp4_self_check.py``), run afresh and written to the cache
   the backend reads; then a compiled training step on it == its eager chain bitwise;
4. (SM10x with ``nvidia-cudnn-frontend``) the cudnn self-check on this GPU, likewise; then a
   compiled training step on the cudnn target == its eager chain bitwise;
5. (CUDA) a forward + backward at S1 and S2 (``benchmarks/grouped_mlp.py``'s shapes, SReLU)
   timed for BF16 (``torch.compile``), the Triton target and the triton_fp4 and cudnn
   targets where they run.

What it cannot run here it lists as skipped, with why. Exits 1 when a check that ran failed,
else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
from typing import Optional

import torch

from .compiler.backend import backend
from .inspection import compare, format_table
from .nn import GroupedMLP, grouped_mlp
from .lowerings import cudnn_sim, fp4_self_check, get_target, register_target, self_check, targets
from .lowerings import unregister_target
from .lowerings.cudnn import capabilities_from_signatures, installed_capabilities, read_signatures, wired
from .lowerings.reference import STEPS as REFERENCE_STEPS

# benchmarks/grouped_mlp.py's SHAPES: experts, tokens, hidden, ffn, uneven routing
SHAPES = {"S1": (8, 16384, 4096, 2048, False), "S2": (8, 65536, 4096, 4096, False)}


class Report:
    def __init__(self):
        self.rows: list[dict] = []
        self.timings: list[dict] = []

    def add(self, check: str, target: str, ok, detail: str) -> None:
        """ok: True / False (a check that ran), None (skipped), "info" (a measurement)."""
        verdict = {True: "PASS", False: "FAIL", None: "skipped", "info": "info"}[ok]
        self.rows.append(dict(check=check, target=target, verdict=verdict, detail=detail))
        print(f"[{verdict}] {target}: {check}: {detail}", flush=True)

    def failures(self) -> int:
        return sum(r["verdict"] == "FAIL" for r in self.rows)

    def cases(self, verdict: self_check.Verdict, target: str) -> None:
        for case in verdict.cases:
            what = f"{case.step}: {case.wrapper}" + (f" ({case.activation})" if case.activation else "")
            self.add(what, target, case.ok, case.line())


def simulated(report: Report) -> None:
    """The self-check over the simulator, on the CPU, never cached."""
    caps = wired(capabilities_from_signatures(read_signatures(cudnn_sim)))
    stack = self_check.Stack("cudnn_sim on CPU", (10, 0), "-", torch.__version__, "1.32 (cudnn_sim)", "-",
                             self_check.package_version(), self_check._version("triton"))
    verdict = self_check.run(cudnn_sim.frontend(), torch.device("cpu"), stack, REFERENCE_STEPS, caps)
    report.cases(verdict, "cudnn over the simulator (CPU)")
    report.add("self-check cost", "cudnn over the simulator (CPU)", "info", f"took {verdict.seconds:.1f} s")


def small_model(device, activation="srelu"):
    torch.manual_seed(0)
    mlp = GroupedMLP(3, 128, 256, activation, device=device)
    x = torch.randn(600, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    return mlp, (x, torch.tensor([100, 0, 500], device=device), torch.rand(600, device=device, requires_grad=True))


@contextlib.contextmanager
def unregistered(*names: str):
    """The targets `names` unregistered inside the block, so a plan on this GPU takes the
    next one: the eager chain that ``compare`` runs follows the registry, not the backend's
    ``cudnn="off"``."""
    if not names:
        yield
        return
    order = [t.name for t in targets()]
    target, after = get_target(names[0]), order[order.index(names[0]) + 1]
    unregister_target(names[0])
    try:
        with unregistered(*names[1:]):
            yield
    finally:
        register_target(target, before=after)


# What each row of the compiled steps and the timings runs: the backend's cudnn option and
# the targets taken out of the registry so that the named one is the plan's.
VARIANTS = {"triton": ("off", ("cudnn", "triton_fp4")), "triton_fp4": ("off", ("cudnn",)),
            "cudnn": ("require", ())}


def compiled_step(report: Report, device, target: str, label: str) -> None:
    cudnn, off = VARIANTS[target]
    for activation in ("srelu", "swiglu"):
        mlp, args = small_model(device, activation)
        torch._dynamo.reset()
        with unregistered(*off):
            result = compare(mlp, backend=backend(cudnn=cudnn))(*args)
        report.add(f"compiled training step == eager chain ({activation})", label, result.bitwise,
                   "bitwise" if result.bitwise else str(result).splitlines()[0])


def on_blackwell(report: Report, device) -> Optional[str]:
    """The self-check on this GPU (afresh, into the cache), then a compiled step; or why not."""
    capability = torch.cuda.get_device_capability(device)
    mismatch = get_target("cudnn").device_mismatch("cuda", capability)
    caps = installed_capabilities()
    if mismatch or isinstance(caps, str):
        return mismatch or caps
    stack = self_check.Stack.of(device)
    self_check.cache_path(stack).unlink(missing_ok=True)
    self_check.forget()
    import cudnn

    from .lowerings.triton import STEPS

    verdict = self_check.verdict(cudnn, device, stack, STEPS, wired(caps))
    report.cases(verdict, f"cudnn on {stack.gpu}")
    report.add("self-check cost", f"cudnn on {stack.gpu}", "info",
               f"took {verdict.seconds:.1f} s; cached at {self_check.cache_path(stack)}")
    if verdict.refusal is None:
        compiled_step(report, device, "cudnn", f"cudnn on {stack.gpu}")
    return None


def fp4_on_blackwell(report: Report, device) -> Optional[str]:
    """The triton_fp4 self-check on this GPU (afresh, into the cache), then a compiled step;
    or why not."""
    capability = torch.cuda.get_device_capability(device)
    caps = get_target("triton").probe(device)
    mismatch = get_target("triton_fp4").device_mismatch("cuda", capability)
    if mismatch or isinstance(caps, str):
        return mismatch or caps
    stack = self_check.Stack.of(device)
    self_check.cache_path(stack, fp4_self_check.KIND).unlink(missing_ok=True)
    self_check.forget()
    from .lowerings.triton import FP4_STEPS

    verdict = fp4_self_check.verdict(device, stack, FP4_STEPS, caps)
    label = f"triton_fp4 on {stack.gpu}"
    report.cases(verdict, label)
    report.add("self-check cost", label, "info",
               f"took {verdict.seconds:.1f} s; cached at {self_check.cache_path(stack, fp4_self_check.KIND)}")
    if verdict.refusal is None:
        compiled_step(report, device, "triton_fp4", label)
    return None


def time_shapes(report: Report, device, shapes, runs: list[str]) -> None:
    from triton.testing import do_bench

    for shape in shapes:
        experts, tokens, hidden, ffn, _ = SHAPES[shape]
        torch.manual_seed(0)
        sizes = torch.full((experts,), tokens // experts, device=device)
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
        w1 = (torch.randn(experts, ffn, hidden, device=device) * hidden ** -0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(experts, hidden, ffn, device=device) * ffn ** -0.5).bfloat16().requires_grad_()
        probs = torch.rand(tokens, device=device, requires_grad=True)
        dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
        offsets = torch.cumsum(sizes, 0).to(torch.int32)

        def bf16(x, w1, w2, sizes, probs):
            c = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(torch.relu(c).square() * probs[:, None].to(c.dtype), w2.transpose(-2, -1),
                                     offs=offsets)

        def nvfp4(x, w1, w2, sizes, probs):
            return grouped_mlp(x, w1, w2, sizes, probs, activation="srelu")

        base = None
        for name in ["bf16", *runs]:
            torch._dynamo.reset()
            cudnn, off = VARIANTS.get(name, (None, ()))
            compiled = torch.compile(bf16) if name == "bf16" else torch.compile(nvfp4, backend=backend(cudnn=cudnn))
            args = (x, w1, w2, sizes, probs)
            with unregistered(*off):
                ms = do_bench(lambda: compiled(*args).backward(dy), grad_to_none=[x, w1, w2, probs])
            base = base or ms
            report.timings.append(dict(shape=shape, variant=name, ms=ms, time_vs_bf16=ms / base))
            print(f"{shape} srelu fwd+bwd {name}: {ms:.3f} ms ({ms / base:.2f}x BF16's time)", flush=True)


def environment() -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, platform=platform.platform(),
               frontend=self_check._version("nvidia-cudnn-frontend"),
               cutlass_dsl=self_check._version("nvidia-cutlass-dsl"), triton=self_check._version("triton"),
               nvfp4_inductor=self_check.package_version(), cuda=torch.version.cuda)
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                   driver=self_check._driver())
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_inductor.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="nvfp4_check.json", help="where to write the report (default: %(default)s)")
    parser.add_argument("--shapes", nargs="+", default=["S1", "S2"], choices=sorted(SHAPES))
    parser.add_argument("--skip-timing", action="store_true")
    opts = parser.parse_args(argv)
    report = Report()
    env = environment()
    print("; ".join(f"{k} {v}" for k, v in env.items()), flush=True)

    simulated(report)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else None
    triton_target = get_target("triton")
    triton_why = "no CUDA device" if not cuda else triton_target.device_mismatch(
        "cuda", torch.cuda.get_device_capability()) or _reason(triton_target.probe(device))
    if triton_why:
        report.add("compiled training step == eager chain", "triton", None, triton_why)
    else:
        compiled_step(report, device, "triton", "triton")
    runs = [] if triton_why else ["triton"]
    for name, on_gpu in (("triton_fp4", fp4_on_blackwell), ("cudnn", on_blackwell)):
        failed_before = report.failures()
        why = "no CUDA device" if not cuda else on_gpu(report, device)
        if why:
            report.add("self-check and compiled step on the GPU", name, None, why)
        elif report.failures() == failed_before:  # timed only where its checks all passed
            runs.append(name)
    if opts.skip_timing or not cuda or triton_why:
        why = "--skip-timing" if opts.skip_timing else triton_why
        report.add(f"timing at {', '.join(opts.shapes)} vs BF16", "bf16 / triton / triton_fp4 / cudnn", None,
                   why)
    else:
        time_shapes(report, device, opts.shapes, runs)

    print()
    print(format_table(["target", "check", "verdict", "detail"],
                       [[r["target"], r["check"], r["verdict"], r["detail"]] for r in report.rows]))
    if report.timings:
        print()
        print(format_table(["shape", "variant", "ms", "time / bf16"],
                           [[t["shape"], t["variant"], f"{t['ms']:.3f}", f"{t['time_vs_bf16']:.2f}"]
                            for t in report.timings]))
    with open(opts.json, "w") as f:
        json.dump(dict(environment=env, checks=report.rows, timings=report.timings), f, indent=1)
    print(f"\nwrote {opts.json}: attach it to a bug report")
    return 1 if any(r["verdict"] == "FAIL" for r in report.rows) else 0


def _reason(caps) -> Optional[str]:
    return caps if isinstance(caps, str) else None


if __name__ == "__main__":
    sys.exit(main())
