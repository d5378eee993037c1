"""``python -m nvfp4_inductor.demo``: a small MoE block trained in NVFP4, eager and compiled.

1. Eager: ``GroupedMLP`` forward + backward in NVFP4 for each activation (the median
   of warm steps), with the error of the output and gradients against the same block
   run in BF16.
2. Compiled: a plain-PyTorch MoE layer (router, token sort, ``torch._grouped_mm`` x2)
   under ``torch.compile(backend="nvfp4")``: a training step's time, first call (it
   compiles) and warm; the explain table; the bitwise compare of the compiled blocks
   against the eager NVFP4 chain.
3. Gradient accumulation: micro-batches of ``GroupedMLP`` with the weights cast on every
   forward, then inside ``nv.reuse_weight_casts()`` (each weight cast once); the
   accumulated gradients compared bit for bit.
Runs on CUDA when present, else on CPU (about a minute).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import nvfp4_inductor as nv
from nvfp4_inductor.inspection import format_table

EXPERTS, HIDDEN, FFN, TOKENS, TOP_K = 4, 64, 64, 256, 2
WARM_STEPS = 7

EXPECTED_ERROR = (
    "What to expect: ~0.25 relative error. The block runs two GEMMs (fc1, fc2) on NVFP4 operands,\n"
    "and NVFP4's 4-bit values with an E4M3 scale per 16 cost ~10% per operand on random data.\n"
    "That is the format's rounding, not a fault; the compare below checks the compiled blocks\n"
    "against the eager NVFP4 chain bit for bit.")


def median_seconds(step: Callable[[], object], warmup: int = 1, repeat: int = WARM_STEPS) -> float:
    """Median wall time of `repeat` calls of `step` after `warmup` untimed ones (the first
    call compiles or fills caches: it is not what a training step costs)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bf16_grouped_mlp(x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale):
    """The same block in BF16 with fp32 activation math: the accuracy baseline."""
    outs = []
    for g, rows in enumerate(torch.split(x, group_sizes.tolist())):
        h = (rows @ fc1_weight[g].t()).float()
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            f = F.silu(gate) * up
        elif activation == "srelu":
            f = torch.relu(h) ** 2
        else:
            f = (tanh_clamp_scale * torch.tanh(torch.relu(h) / tanh_clamp_scale)) ** 2
        outs.append(f)
    d = (torch.cat(outs) * probs.float()[:, None]).bfloat16()
    return torch.cat([rows @ fc2_weight[g].t() for g, rows in enumerate(torch.split(d, group_sizes.tolist()))])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def eager_table(device) -> str:
    rows = []
    for activation, clamp in (("srelu", None), ("tanh_srelu", 4.0), ("swiglu", None)):
        torch.manual_seed(0)
        mlp = nv.GroupedMLP(EXPERTS, HIDDEN, FFN, activation, clamp, device=device)
        x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
        group_sizes = torch.tensor([70, 0, 100, 86], device=device)
        probs = torch.rand(TOKENS, device=device, requires_grad=True)
        dy = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
        y = mlp(x, group_sizes, probs)
        grads = torch.autograd.grad(y, (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy)
        seconds = median_seconds(  # the step above was the warm-up
            lambda: torch.autograd.grad(mlp(x, group_sizes, probs), (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy),
            warmup=0)
        y_ref = bf16_grouped_mlp(x, mlp.fc1_weight, mlp.fc2_weight, group_sizes, probs, activation, clamp)
        ref = torch.autograd.grad(y_ref, (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy)
        rows.append([activation, f"{seconds * 1e3:.0f} ms", f"{relative_error(y, y_ref):.3f}"]
                    + [f"{relative_error(g, r):.3f}" for g, r in zip(grads, ref)])
    return format_table(["activation", "fwd+bwd (warm)", "err Y", "err dX", "err dW1", "err dW2", "err dprob"], rows)


class MoELayer(torch.nn.Module):
    """A top-k routed MoE layer written the way model libraries write it today."""

    def __init__(self, device):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False, device=device, dtype=torch.bfloat16)
        scale = HIDDEN**-0.5
        self.gate_up = torch.nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN, device=device).mul(scale).bfloat16())
        self.down = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN, device=device).mul(FFN**-0.5).bfloat16())

    def forward(self, x):
        scores = self.router(x).float().softmax(dim=-1)
        probs, experts = scores.topk(TOP_K, dim=-1)
        order = experts.reshape(-1).argsort(stable=True)
        x_sorted = x[order // TOP_K]
        counts = torch.histc(experts.reshape(-1).float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(x_sorted, self.gate_up.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offs)
        y = y * probs.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, order // TOP_K, y)
        return x + out


def compiled_step_table(layer: MoELayer, x: torch.Tensor) -> str:
    """A training step (forward + backward) of the layer compiled with the nvfp4 backend:
    the first call, which compiles, and the median warm step."""
    step = torch.compile(layer, backend="nvfp4")

    def train_step():
        step(x).backward(torch.ones_like(x))

    start = time.perf_counter()
    train_step()
    first = time.perf_counter() - start
    return format_table(["compiled training step", "time"], [
        ["first call (Dynamo trace + Inductor compile)", f"{first:.1f} s"],
        [f"warm step (median of {WARM_STEPS})", f"{median_seconds(train_step, warmup=0) * 1e3:.1f} ms"],
    ])


def accumulation_table(device, micro_batches: int = 4) -> str:
    """`micro_batches` forward + backward passes of one GroupedMLP, gradients accumulated,
    with its weights cast every time and then inside a reuse_weight_casts block."""
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(EXPERTS, HIDDEN, FFN, "swiglu", device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(TOKENS, HIDDEN, device=device, generator=gen).bfloat16() for _ in range(micro_batches)]
    sizes = torch.full((EXPERTS,), TOKENS // EXPERTS, device=device)

    def accumulate():
        mlp.zero_grad()
        torch.manual_seed(2)  # the same stochastic-rounding draws both times
        for x in xs:
            mlp(x, sizes).float().square().mean().backward()
        return [p.grad.clone() for p in mlp.parameters()]

    every_time = accumulate()
    with nv.reuse_weight_casts() as reuse:
        reused = accumulate()
        kept = reuse.kept_bytes  # freed when the block ends
    same = all(torch.equal(a, b) for a, b in zip(every_time, reused))
    return format_table(["micro-batches", "weight stacks cast", "casts reused", "copies kept", "gradients"], [
        [str(micro_batches), str(reuse.casts), str(reuse.reuses), f"{kept / 2**10:.1f} KiB",
         "bitwise equal" if same else "DIFFER"],
    ])


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # tensors this small gain nothing from more threads, and lose much on a busy machine
        torch.set_num_threads(1)
    threads = f", {torch.get_num_threads()} CPU thread" if device == "cpu" else ""
    print(f"nvfp4_inductor demo on {device}{threads}: {EXPERTS} experts, H={HIDDEN}, F={FFN}, T={TOKENS}\n")
    print("1. eager NVFP4 GroupedMLP, forward + backward; relative error against the same block in BF16")
    print(eager_table(device))
    print(EXPECTED_ERROR)
    torch.manual_seed(0)
    layer = MoELayer(device)
    x = torch.randn(TOKENS // TOP_K, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    print("\n2. torch.compile(MoELayer, backend=\"nvfp4\"): a training step, what the backend found, and the")
    print("   compiled blocks against the eager NVFP4 chain")
    print(compiled_step_table(layer, x))
    print()
    print(nv.explain(layer)(x))
    print()
    print(nv.compare(layer)(x))
    print("\n3. gradient accumulation: the weights cast once per optimizer step (nv.reuse_weight_casts),")
    print("   against casting them on every micro-batch")
    print(accumulation_table(device))


if __name__ == "__main__":
    main()
