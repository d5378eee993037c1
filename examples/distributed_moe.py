"""FSDP2, expert parallelism and rank-aware stochastic rounding with the nvfp4 backend.

    torchrun --nproc-per-node 2 examples/distributed_moe.py                  # CPU, gloo
    torchrun --nproc-per-node 2 examples/distributed_moe.py --device cuda    # GPUs, NCCL

Three short runs, each checked against a single-process run on every rank, then a verdict
table on rank 0 (docs/distributed.md explains each pattern):

1. FSDP2: ``fully_shard`` the MoE block and the model, then compile the block. With
   ``Recipe(sr_per_rank=False)`` and every rank seeded alike, the reduced gradients are
   bitwise the single-process gradients of the ranks' batches, averaged.
2. Expert parallelism in one graph: rows and per-expert counts dispatched with functional
   all-to-alls, G / world experts per rank, combined back; compiled with ``fullgraph=True``.
   Bitwise the single-process G-expert layer over every rank's tokens (rounding to nearest).
3. Stochastic rounding: with the default ``Recipe()`` ranks seeded alike draw different
   rounding bits (the rank is folded into each Philox key); with ``sr_per_rank=False`` they
   draw the same.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import nvfp4_inductor as nv

G, H, F, T = 4, 64, 64, 128  # experts, hidden, ffn, tokens per rank


def batch(rank: int, device):
    """Rank `rank`'s tokens: x (T, H) bf16, expert ids, router probabilities, dY."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids, probs = torch.randint(0, G, (T,), generator=gen), torch.rand(T, generator=gen)
    return tuple(t.to(device) for t in (x, ids, probs, torch.randn(T, H, generator=gen).bfloat16()))


class MoEBlock(nn.Module):
    """Top-1 router, tokens sorted by expert, ``histc`` counts (``bincount`` would break the
    graph: its output size depends on the data), NVFP4 experts, residual."""

    def __init__(self, recipe, device):
        super().__init__()
        self.gate = nn.Linear(H, G, bias=False, dtype=torch.bfloat16, device=device)
        self.experts = nv.GroupedMLP(G, H, F, recipe=recipe, device=device)

    def forward(self, x):
        probs, ids = torch.softmax(self.gate(x).float(), dim=-1).max(dim=-1)
        order = torch.argsort(ids, stable=True)
        counts = torch.histc(ids.float(), bins=G, min=0, max=G - 1).to(torch.int32)
        return x + self.experts(x[order], counts, probs[order])[torch.argsort(order)]


class ExpertParallelMoE(nn.Module):
    """`experts` experts split over the ranks of `group` (default: all). Each rank sorts its
    rows by expert, exchanges the per-expert counts, sends each row to the rank owning its
    expert, runs its local experts on the rows ordered by (local expert, source rank) and
    sends the results back."""

    def __init__(self, experts: int, hidden: int, ffn: int, recipe, device=None, group=None):
        super().__init__()
        self.group = group or dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.total, self.local = experts, experts // self.world
        self.experts = nv.GroupedMLP(self.local, hidden, ffn, recipe=recipe, device=device)

    def forward(self, x, expert_ids, probs):
        group, world, local = self.group, self.world, self.local
        order = torch.argsort(expert_ids, stable=True)
        # histc, not bincount: its output size is static, so the graph holds no host sync
        counts = torch.histc(expert_ids.float(), bins=self.total, min=0, max=self.total - 1).to(torch.int64)
        received = funcol.all_to_all_single(counts, None, None, group)  # per source rank, per local expert
        send = counts.view(world, local).sum(1).tolist()  # unbacked sizes under capture_scalar_outputs
        recv = received.view(world, local).sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x[order], recv, send, group)
        p = funcol.all_to_all_single_autograd(probs[order], recv, send, group)
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(world), received,
                                                output_size=rows.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = self.experts(rows[by_expert], received.view(world, local).sum(0), p[by_expert])
        y = funcol.all_to_all_single_autograd(y[torch.argsort(by_expert)], send, recv, group)
        return y[torch.argsort(order)]


def bitwise(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def all_ranks(ok: bool, device) -> bool:
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def fsdp2(device, backend):
    recipe = nv.Recipe(sr_per_rank=False)  # SR on, reproducible by one process
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    single = MoEBlock(recipe, device)
    block = MoEBlock(recipe, device)
    block.load_state_dict(single.state_dict())
    fully_shard(block.experts)
    fully_shard(block)
    block.compile(backend=backend(recipe))  # compile after fully_shard
    torch.manual_seed(1)
    block(batch(rank, device)[0]).float().square().mean().backward()
    grads = {}
    for r in range(world):  # the single-process run of every rank's batch, same seed
        single.zero_grad()
        torch.manual_seed(1)
        single(batch(r, device)[0]).float().square().mean().backward()
        for name, p in single.named_parameters():
            grads[name] = p.grad.clone() if name not in grads else grads[name] + p.grad
    ok = all(bitwise(p.grad.full_tensor(), grads[name] / world) for name, p in block.named_parameters())
    return "FSDP2, block compiled", "gradients == 1-process average", all_ranks(ok, device)


def expert_parallel(device, backend):
    recipe = nv.Recipe(stochastic_rounding=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    single = nv.GroupedMLP(G, H, F, recipe=recipe, device=device)
    layer = ExpertParallelMoE(G, H, F, recipe, device)
    mine = slice(rank * layer.local, (rank + 1) * layer.local)
    with torch.no_grad():
        layer.experts.fc1_weight.copy_(single.fc1_weight[mine])
        layer.experts.fc2_weight.copy_(single.fc2_weight[mine])
    x, ids, p, dy = batch(rank, device)
    x.requires_grad_(), p.requires_grad_()
    torch._dynamo.config.capture_scalar_outputs = True  # .tolist() stays in the graph
    y = torch.compile(layer, backend=backend(recipe), fullgraph=True)(x, ids, p)
    y.backward(dy)
    xs, idss, ps, dys = (torch.cat(t) for t in zip(*(batch(r, device) for r in range(world))))
    xs.requires_grad_(), ps.requires_grad_()
    order = torch.argsort(idss, stable=True)
    ys = single(xs[order], torch.bincount(idss, minlength=G), ps[order])[torch.argsort(order)]
    ys.backward(dys)
    rows = slice(rank * T, (rank + 1) * T)
    ok = (bitwise(y, ys[rows]) and bitwise(x.grad, xs.grad[rows]) and bitwise(p.grad, ps.grad[rows])
          and bitwise(layer.experts.fc1_weight.grad, single.fc1_weight.grad[mine])
          and bitwise(layer.experts.fc2_weight.grad, single.fc2_weight.grad[mine]))
    return "expert parallel, one graph", "Y, dX, dprob, dW == 1 process", all_ranks(ok, device)


def rounding_bits(device, sr_per_rank: bool):
    """Whether the ranks' stochastically rounded dY codes are all equal (seeded alike)."""
    x, _, _, _ = batch(0, device)
    torch.manual_seed(1)
    q = nv.group_quantize(x, torch.tensor([T], device=device), stochastic_rounding=True, sr_per_rank=sr_per_rank)
    codes = q.rowwise_data.reshape(-1)
    gathered = [torch.empty_like(codes) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, codes)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--compiler", default=None, choices=("inductor", "aot_eager"),
                        help="what compiles the rewritten graphs (default: inductor on cuda, aot_eager on cpu)")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    compiler = args.compiler or ("inductor" if args.device == "cuda" else "aot_eager")

    def backend(recipe):
        return nv.backend(recipe=recipe, compiler=compiler)

    rows = [fsdp2(device, backend), expert_parallel(device, backend)]
    differ = not rounding_bits(device, sr_per_rank=True)
    rows.append(("SR, Recipe()", "ranks draw different bits", differ or dist.get_world_size() == 1))
    rows.append(("SR, Recipe(sr_per_rank=False)", "ranks draw the same bits", rounding_bits(device, False)))
    if dist.get_rank() == 0:
        print(f"world size {dist.get_world_size()}, {args.device}, compiler={compiler}")
        print(f"{'scenario':<32}{'check':<34}verdict")
        for scenario, check, ok in rows:
            print(f"{scenario:<32}{check:<34}{'pass' if ok else 'FAIL'}")
    dist.destroy_process_group()
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
