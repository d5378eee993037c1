"""Question: how fast and how lean is NVFP4 grouped-MLP training (forward + backward)
compared with BF16, per implementation, at the issue's shapes?

Rows (one process, one GPU): BF16 torch.compile of a torch._grouped_mm MLP (the baseline,
1.00); stock torch.compile of the NVFP4 chain in plain PyTorch ops (fake-quant: every
operand of the six GEMMs quantize-dequantized as ours are, benchmarks/fake_quant.py); our eager
NVFP4 (op by op); our compiled NVFP4, recompute on and off. Columns: forward+backward time
relative to the baseline, TFLOP/s (6 * T * H * F1' flops per GEMM trio, counted the same
for every row), peak memory, bytes saved for backward (unique storages, via
saved_tensors_hooks). Times: triton.testing.do_bench median after warm-up, random data.

    python benchmarks/grouped_mlp.py [--shapes S1 S2 S3] [--activations srelu swiglu] [--profile]
                                     [--host-profile] [--skip fake-quant eager save-D]

--profile adds, per shape and activation, the GPU kernels of one compiled NVFP4 step
(recompute on) sorted by time: where the time goes. --host-profile adds the same step's
host-side Python functions by own time (cProfile). The "host ms" column is the time to
enqueue one step without waiting for the GPU: where it reaches "ms", the row is
host-bound and its ratio depends on the CPU as much as on the kernels.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import nvfp4_inductor as nv
from nvfp4_inductor.inspection import format_table

from fake_quant import fake_quant_mlp

SHAPES = {  # experts, tokens, hidden, ffn, uneven routing
    "S1": (8, 16384, 4096, 2048, False),
    "S2": (8, 65536, 4096, 4096, False),
    "S3": (32, 32768, 2048, 768, True),
}


def routing(experts, tokens, uneven, device):
    gen = torch.Generator(device=device).manual_seed(0)
    weights = torch.rand(experts, device=device, generator=gen) ** (3 if uneven else 0)
    ids = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=experts)


def activation_fn(name, h):
    if name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.relu(h) ** 2


def bf16_mlp(activation):
    def run(x, w1, w2, sizes, probs):
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        d = (activation_fn(activation, h.float()) * probs[:, None]).bfloat16()
        return torch._grouped_mm(d, w2.transpose(-2, -1), offs=offs)

    return run


def nvfp4_mlp(activation):
    def run(x, w1, w2, sizes, probs):
        return nv.grouped_mlp(x, w1, w2, sizes, probs, activation=activation)

    return run


def saved_bytes(fn, args) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


def training_step(fn, args, grad):
    """One forward + backward of `fn` on (x, w1, w2, sizes, probs): the step every row times."""

    def step():
        y = fn(*args)
        torch.autograd.grad(y, (args[0], args[1], args[2], args[4]), grad)

    return step


def measure(fn, args, grad):
    from triton.testing import do_bench

    step = training_step(fn, args, grad)
    start = time.perf_counter()
    step()  # compile / warm up
    torch.cuda.synchronize()
    print(f"  first step (compile, warm-up) {time.perf_counter() - start:.0f} s", flush=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(step, warmup=50, rep=300, return_mode="median")
    return ms, peak, saved_bytes(fn, args), host_ms(step)


def host_ms(step, steps=5) -> float:
    """Host time to enqueue one step: steps run back to back without a sync, so the CPU
    does not wait for the GPU as long as their launches fit in the launch queue (~1000
    deep): true of the NVFP4 and BF16 rows (~40 launches a step). The fake-quant row's
    figure came out at ~0.8x its GPU time (runs E10, E11): read it as "the host waited",
    not as host time (unverified: its launch count was not taken). A step whose host time
    reaches its GPU time is host-bound."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / steps * 1e3


def host_breakdown(fn, args, grad, steps=20, top=16):
    """Where the host time of a step goes: cProfile over `steps` steps, functions by own time."""
    import cProfile
    import pstats

    step = training_step(fn, args, grad)
    step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, prim, own s, cum s, callers)
    entries = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = [[f"{name} ({file.rsplit('/', 2)[-2] + '/' + file.rsplit('/', 1)[-1] if '/' in file else file}:{line})"[:70],
             f"{calls / steps:.0f}", f"{own / steps * 1e3:.3f}", f"{cum / steps * 1e3:.3f}"]
            for (file, line, name), (_prim, calls, own, cum, _callers) in entries]
    total = sum(v[2] for v in stats.values()) / steps * 1e3
    return format_table(["function (own time)", "calls/step", "own ms/step", "cum ms/step"], rows) + \
        f"\nhost total {total:.3f} ms/step (under cProfile, which inflates call-heavy code)"


_SKIPPABLE = {"fake-quant": "fake-quant, stock Inductor", "eager": "nvfp4 eager", "save-D": "nvfp4 compiled, save D"}


def kernel_breakdown(fn, args, grad, top=14):
    """Per-kernel GPU time of one forward+backward step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    step = training_step(fn, args, grad)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 3
    rows = [[e.key[:60], str(e.count // 3), f"{e.device_time_total / 3 / 1e3:.3f}",
             f"{100 * e.device_time_total / 3 / total:.0f}%"] for e in events[:top]]
    return format_table(["kernel", "calls/step", "ms/step", "share"], rows) + f"\ntotal {total / 1e3:.3f} ms/step"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--activations", nargs="+", default=["srelu", "swiglu"])
    parser.add_argument("--profile", action="store_true", help="print the kernel breakdown of compiled NVFP4")
    parser.add_argument("--host-profile", action="store_true",
                        help="print where the host time of a compiled NVFP4 step goes (cProfile)")
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(_SKIPPABLE),
                        help="rows to leave out (each compile costs device time); the baseline always runs")
    args_ns = parser.parse_args()
    device = "cuda"
    rows = []
    for shape in args_ns.shapes:
        experts, tokens, hidden, ffn, uneven = SHAPES[shape]
        for activation in args_ns.activations:
            f1 = 2 * ffn if activation == "swiglu" else ffn
            sizes = routing(experts, tokens, uneven, device)
            x = torch.randn(tokens, hidden, device=device).bfloat16().requires_grad_()
            w1 = (torch.randn(experts, f1, hidden, device=device) * hidden**-0.5).bfloat16().requires_grad_()
            w2 = (torch.randn(experts, hidden, ffn, device=device) * ffn**-0.5).bfloat16().requires_grad_()
            probs = torch.rand(tokens, device=device).requires_grad_()
            grad = torch.randn(tokens, hidden, device=device).bfloat16()
            flops = 3 * 2 * tokens * hidden * (f1 + ffn)  # fwd + dgrad + wgrad of both GEMMs
            variants = {  # fake-quant last: its compile is the longest
                "bf16 compiled (baseline)": torch.compile(bf16_mlp(activation)),
                "nvfp4 eager": nvfp4_mlp(activation),
                "nvfp4 compiled, recompute": torch.compile(nvfp4_mlp(activation), backend=nv.backend(recompute=True)),
                "nvfp4 compiled, save D": torch.compile(nvfp4_mlp(activation), backend=nv.backend(recompute=False)),
                "fake-quant, stock Inductor": torch.compile(fake_quant_mlp(lambda c: activation_fn(activation, c))),
            }
            for key in args_ns.skip:
                variants.pop(_SKIPPABLE[key])
            base_ms = base_saved = None
            for name, fn in variants.items():
                try:
                    ms, peak, saved, host = measure(fn, (x, w1, w2, sizes, probs), grad)
                except Exception as error:  # a failing variant is reported, not hidden
                    rows.append([shape, activation, name, f"failed: {type(error).__name__}: {error}"[:80]])
                    continue
                base_ms = base_ms or ms
                base_saved = base_saved or saved
                rows.append([shape, activation, name, f"{ms / base_ms:.2f}", f"{ms:.2f}",
                             f"{flops / ms / 1e9:.0f}", f"{peak / 2**30:.2f}", f"{saved / 2**20:.0f}",
                             f"{saved / base_saved:.2f}", f"{host:.2f}"])
                print(" | ".join(rows[-1]), flush=True)  # progress: a cut-off run still reports
                if args_ns.profile and name == "nvfp4 compiled, recompute":
                    print(kernel_breakdown(fn, (x, w1, w2, sizes, probs), grad), flush=True)
                if args_ns.host_profile and name == "nvfp4 compiled, recompute":
                    print(host_breakdown(fn, (x, w1, w2, sizes, probs), grad), flush=True)
            torch._dynamo.reset()
    print(format_table(["shape", "act", "implementation", "time/bf16", "ms", "TFLOP/s", "peak GiB",
                        "saved MiB", "saved/bf16", "host ms"], rows))


if __name__ == "__main__":
    main()
