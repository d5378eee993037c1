"""Scale-out scenarios for tests/test_distributed.py: one process per rank, every scenario in
one launch (each process pays torch's import and its compiles once), results written back
as JSON. pytest-free: ``launch`` starts the ranks the way torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and returns each rank's results.

    python tests/distributed_scenarios.py --out DIR [--device cuda] [scenario ...]   (per rank)

Every scenario compares bytes (``_assertions.assert_bytes_equal``) with zero tolerance:

    fsdp2_compiled         FSDP2 (bf16), the MoE block compiled after fully_shard (aot_eager):
                           every gradient == the single-process run of each rank's batch,
                           summed and divided by the world size; one site rewritten
    fsdp2_mixed_precision  the same with fp32 parameters, bf16 compute and fp32 gradient
                           reduction (MixedPrecisionPolicy(bf16, reduce_dtype=fp32))
    fsdp2_inductor         the experts compiled with Inductor under FSDP2 (the one Inductor case)
    fsdp2_checkpointed     fsdp2_compiled with the MoE block under activation checkpointing
                           (torchtitan's checkpoint_wrapper, then fully_shard, then compile)
    fsdp2_inspection       explain, a no_grad forward, then compare on the FSDP2 root module:
                           every output and gradient compared, bitwise; .grad left as it was
    ep_eager               expert parallel: rows and per-expert counts dispatched with
                           all_to_all_single, G/W experts per rank, combined back: Y, dX, dprob,
                           dW1, dW2 == a single-process G-expert run over every rank's tokens
    ep_one_graph           the same layer compiled whole (fullgraph, functional collectives,
                           counts .tolist() under capture_scalar_outputs): one graph, one site
    transformers_ep_fsdp2  transformers' native expert parallelism + FSDP2 (DistributedConfig),
                           a tiny Qwen3-MoE compiled whole: compare() bitwise on every rank
                           (needs transformers and accelerate: the test extra)
    ep_fsdp2               (4+ ranks, MESH_SCENARIOS) expert parallelism inside FSDP2 on a
                           (dp, ep) = (2, world/2) mesh, the layer compiled after fully_shard:
                           Y, dX, dprob == the single-process run of the rank's ep group; dW1,
                           dW2 == those runs' gradients averaged over the 2 dp groups
    dtensor_shard0         GroupedMLP with Shard(0) DTensor experts and local rows, eager and
                           compiled == the local G/W-expert run; gradients Shard(0)
    dtensor_replicate      all-Replicate DTensors: eager and compiled (site rejected with its
                           reason) == the plain run; SR with sr_per_rank raises, without it matches
    dtensor_rejections     other placements: a ValueError naming the argument; explain gives the
                           reason for a grouped_mm site with DTensor weights
    sr_ranks               stochastic rounding: the seed rule, bits reproducible run to run, ranks
                           drawing different bits (the same with sr_per_rank=False), compiled ==
                           eager per rank

Stochastic rounding is on wherever a single-process reference can reproduce it
(``Recipe(sr_per_rank=False)``, every rank seeded alike before its step, the reference seeded
the same before each rank's batch); expert parallelism quantizes each rank's rows as one
matrix, so its Philox block indices differ from the single-process run: SR off there.
CPU runs use the reference target (the Triton interpreter would cost minutes and changes
nothing about composition); a CUDA run uses whatever the policy picks, as users get.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import inspect
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import nvfp4_inductor as nv
from nvfp4_inductor.numerics import draw_seed

from _assertions import assert_bytes_equal, dtypes_kept_for_backward

# The expert-parallel layer users are shown (examples/distributed_moe.py) is the one tested.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from distributed_moe import ExpertParallelMoE  # noqa: E402

G, H, F, T = 4, 32, 32, 48  # experts, hidden, ffn, tokens per rank
BF16 = torch.bfloat16
SR_SINGLE = nv.Recipe(sr_per_rank=False)  # SR on, reproducible by a single process
RNE = nv.Recipe(stochastic_rounding=False)
STEP_SEED = 7

SCENARIOS = ("fsdp2_compiled", "fsdp2_mixed_precision", "fsdp2_inductor", "fsdp2_checkpointed", "fsdp2_micro_batches",
             "fsdp2_inspection", "ep_eager", "ep_one_graph", "transformers_ep_fsdp2", "dtensor_shard0",
             "dtensor_replicate", "dtensor_rejections", "sr_ranks")
MESH_SCENARIOS = ("ep_fsdp2",)  # a 2-D mesh: 4 ranks or more (launched apart from SCENARIOS)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _transformers_expert_parallel() -> bool:
    """transformers' own expert parallelism, ``DistributedConfig(ep_size=...)`` (newer
    than 5.17; the test extra's transformers has it)."""
    if not _installed("transformers"):
        return False
    from transformers.distributed import DistributedConfig

    return "ep_size" in inspect.signature(DistributedConfig).parameters


# what a scenario needs beyond our package (the test extra), each with its check
NEEDS = {"transformers_ep_fsdp2": {"transformers with DistributedConfig(ep_size=...)": _transformers_expert_parallel,
                                   "accelerate": lambda: _installed("accelerate")}}


def missing(name: str) -> list[str]:
    """What scenario `name` needs that is not installed (or too old)."""
    return [need for need, present in NEEDS.get(name, {}).items() if not present()]


# ----------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, out_dir, *, device: str = "cpu", scenarios=(), timeout: float = 240.0) -> dict:
    """Run the scenarios in `world_size` processes; {rank: {scenario: {"ok", "detail", "seconds"}}}.
    A scenario a rank did not report (it crashed, or hung past `timeout`) fails with the tail
    of that rank's output."""
    out_dir = pathlib.Path(out_dir)
    root = pathlib.Path(__file__).resolve().parent.parent
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                   TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", OMP_NUM_THREADS="1")
        env.pop("TRITON_INTERPRET", None)  # CPU: the reference target (see the docstring)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--out", str(out_dir), "--device", device,
                                        *scenarios], env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    names = scenarios or SCENARIOS
    results = {}
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
        for name in names:
            if name not in results[rank]:
                tail = (out_dir / f"rank{rank}.log").read_text()[-3000:]
                results[rank][name] = {"ok": False, "seconds": None, "detail": (
                    f"not reported (exit code {procs[rank][0].returncode}); the rank's output:\n{tail}")}
    return results


# ----------------------------------------------------------------------------- helpers


class Context:
    def __init__(self, device: str, out: str):
        self.rank, self.world, self.out = dist.get_rank(), dist.get_world_size(), out
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self._mesh = None

    @property
    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh


def same(actual, expected, label):
    assert_bytes_equal(actual.detach(), expected.detach(), label)


def gather_bytes(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's copy of `t` as raw bytes (uint8), on the CPU."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return [o.cpu() for o in out]


def sites_rewritten() -> int:
    from torch._dynamo.utils import counters

    return counters["nvfp4"]["sites_rewritten"]


def fresh_counters():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def tokens(rank: int, device):
    """Rank `rank`'s batch: x (T, H) bf16, expert ids (T,), router probs (T,) fp32, dY (T, H)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen).to(BF16)
    ids = torch.randint(0, G, (T,), generator=gen)
    probs = torch.rand(T, generator=gen)
    dy = torch.randn(T, H, generator=gen).to(BF16)
    return tuple(t.to(device) for t in (x, ids, probs, dy))


# ----------------------------------------------------------------------------- FSDP2


class MoEBlock(nn.Module):
    """Router (top-1 softmax), tokens sorted by expert, histc counts (no graph break, unlike
    bincount), GroupedMLP experts, residual."""

    def __init__(self, recipe, dtype=BF16, device=None):
        super().__init__()
        self.gate = nn.Linear(H, G, bias=False, dtype=dtype, device=device)
        self.experts = nv.GroupedMLP(G, H, F, recipe=recipe, dtype=dtype, device=device)

    def forward(self, x):
        probs, ids = torch.softmax(self.gate(x).float(), dim=-1).max(dim=-1)
        order = torch.argsort(ids, stable=True)
        counts = torch.histc(ids.float(), bins=G, min=0, max=G - 1).to(torch.int32)
        y = self.experts(x[order], counts, probs[order])
        return x + y[torch.argsort(order)]


class Model(nn.Module):
    def __init__(self, recipe, dtype=BF16, device=None):
        super().__init__()
        self.moe = MoEBlock(recipe, dtype, device)
        self.out = nn.Linear(H, H, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.out(self.moe(x))


def _loss(model, x):
    return model(x).float().square().mean()


def _fsdp2(ctx: Context, *, mixed_precision: bool, compile_what: str, compiler: str, checkpointed=False) -> str:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    recipe = SR_SINGLE
    dtype = torch.float32 if mixed_precision else BF16
    torch.manual_seed(0)
    reference = Model(recipe, dtype, ctx.device)
    model = Model(recipe, dtype, ctx.device)
    model.load_state_dict(reference.state_dict())
    if checkpointed:  # torchtitan's order: checkpoint the block, then shard, then compile
        model.moe = checkpoint_wrapper(model.moe, preserve_rng_state=False)
    # reduce_dtype named: without it torch < 2.15 reduces in param_dtype, 2.15 in the
    # parameters' dtype; fp32 is what torchtitan sets (and 2.15's default for fp32 masters)
    mixed = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    policy = {"mp_policy": mixed} if mixed_precision else {}
    fully_shard(model.moe, **policy)
    fully_shard(model, **policy)
    fresh_counters()
    target = model.moe if compile_what == "block" else model.moe.experts
    target.compile(backend=nv.backend(recipe=recipe, compiler=compiler))  # after fully_shard
    torch.manual_seed(STEP_SEED)  # every rank alike: with sr_per_rank=False, the reference's seeds
    with dtypes_kept_for_backward() as kept:
        loss = _loss(model, tokens(ctx.rank, ctx.device)[0])
    loss.backward()
    assert sites_rewritten() == 1, f"{sites_rewritten()} sites rewritten, expected 1"
    packed = {torch.uint8, torch.float8_e4m3fn} & set(kept)  # the block's NVFP4 copies
    assert bool(packed) != checkpointed, f"kept for backward: {sorted(map(str, set(kept)))}"

    # Single process: each rank's batch with the step's seed (bf16 copies of fp32 masters
    # when mixed precision), gradients summed over ranks in the reduce dtype (fp32 when mixed
    # precision), divided by the world size.
    compute = Model(recipe, BF16, ctx.device)
    compute.load_state_dict({k: v.to(BF16) for k, v in reference.state_dict().items()})
    total = {}
    for rank in range(ctx.world):
        compute.zero_grad()
        torch.manual_seed(STEP_SEED)
        _loss(compute, tokens(rank, ctx.device)[0]).backward()
        for name, p in compute.named_parameters():
            grad = p.grad.to(dtype, copy=True)
            total[name] = grad if name not in total else total[name] + grad
    # collectives first; the checkpoint wrapper's prefix dropped from the names
    gathered = {name.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
                for name, p in model.named_parameters()}
    for name, grad in gathered.items():
        same(grad, total[name] / ctx.world, f"grad {name}")
    return f"{len(total)} gradients bitwise, 1 site"


def fsdp2_compiled(ctx):
    return _fsdp2(ctx, mixed_precision=False, compile_what="block", compiler="aot_eager")


def fsdp2_mixed_precision(ctx):
    return _fsdp2(ctx, mixed_precision=True, compile_what="block", compiler="aot_eager")


def fsdp2_inductor(ctx):
    return _fsdp2(ctx, mixed_precision=False, compile_what="experts", compiler="inductor")


def fsdp2_checkpointed(ctx):
    return _fsdp2(ctx, mixed_precision=False, compile_what="block", compiler="aot_eager", checkpointed=True)


def fsdp2_micro_batches(ctx):
    """Gradient accumulation as FSDP2 users set it up (fp32 masters, bf16 compute; the
    parameters left unsharded between micro-batches, gradients reduced after the last), with
    the weights' casts reused (nvfp4_inductor.reuse_weight_casts): each rank casts W1 and W2
    once for 3 micro-batches, and the gradients equal the same run casting every time."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    micro_batches = 3
    torch.manual_seed(0)
    start = Model(SR_SINGLE, torch.float32, ctx.device).state_dict()

    def accumulate(reuse: bool):
        model = Model(SR_SINGLE, torch.float32, ctx.device)
        model.load_state_dict(start)
        for module in (model.moe, model):
            fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=BF16), reshard_after_forward=False)
        fresh_counters()
        model.moe.compile(backend=nv.backend(recipe=SR_SINGLE, compiler="aot_eager", reuse_weight_casts=reuse))
        torch.manual_seed(STEP_SEED)
        with nv.reuse_weight_casts() if reuse else contextlib.nullcontext() as block:
            for i in range(micro_batches):
                last = i == micro_batches - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
                _loss(model, tokens(ctx.world * i + ctx.rank, ctx.device)[0]).backward()
        assert sites_rewritten() == 1, f"{sites_rewritten()} sites rewritten, expected 1"
        return {name: p.grad.full_tensor() for name, p in model.named_parameters()}, block

    every_time, _ = accumulate(reuse=False)
    reused, block = accumulate(reuse=True)
    assert (block.casts, block.reuses) == (2, 2 * (micro_batches - 1)), (block.casts, block.reuses)
    for name, grad in reused.items():
        same(grad, every_time[name], f"grad {name}")
    return f"{len(reused)} gradients bitwise, W1 and W2 cast once for {micro_batches} micro-batches"


def fsdp2_inspection(ctx):
    """explain, an evaluation and compare on an FSDP2 root module itself (not a wrapper), in
    the order a user runs them: compare finds every parameter's gradient (FSDP2 keeps the
    root's all-gathered parameters registered after a forward that no backward followed)
    and leaves the caller's own gradients in place."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model(SR_SINGLE, BF16, ctx.device)
    fully_shard(model.moe)
    fully_shard(model)
    x = tokens(ctx.rank, ctx.device)[0]
    _loss(model, x).backward()  # a training step's gradients, which compare must put back
    before = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    explained = nv.explain(model)(x)
    assert len(explained.sites) == 1, str(explained)
    with torch.no_grad():
        model(x)
    report = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(x)
    assert report.sites == 1 and report.bitwise, str(report)
    unchecked = [r.name for r in report.rows if r.note]
    assert not unchecked, f"not compared: {unchecked}"
    for name, p in model.named_parameters():
        same(p.grad.to_local(), before[name], f"{name}.grad after compare")
    return f"explain 1 site; compare: {len(report.rows)} outputs and gradients bitwise; .grad kept"


# ----------------------------------------------------------------------------- expert parallel


def _ep(ctx: Context, *, compiled: bool) -> str:
    torch.manual_seed(0)
    full = nv.GroupedMLP(G, H, F, recipe=RNE, device=ctx.device)
    layer = ExpertParallelMoE(G, H, F, RNE, ctx.device)
    mine = slice(ctx.rank * layer.local, (ctx.rank + 1) * layer.local)
    with torch.no_grad():
        layer.experts.fc1_weight.copy_(full.fc1_weight[mine])
        layer.experts.fc2_weight.copy_(full.fc2_weight[mine])

    # Single process: every rank's tokens, rank order, sorted by expert (stable).
    batches = [tokens(rank, ctx.device) for rank in range(ctx.world)]
    x_all, ids_all, p_all, dy_all = (torch.cat(parts) for parts in zip(*batches))
    x_all.requires_grad_(), p_all.requires_grad_()
    order = torch.argsort(ids_all, stable=True)
    y_all = full(x_all[order], torch.bincount(ids_all, minlength=G), p_all[order])[torch.argsort(order)]
    y_all.backward(dy_all)

    x, ids, p, dy = tokens(ctx.rank, ctx.device)
    x.requires_grad_(), p.requires_grad_()
    fresh_counters()
    run = layer
    if compiled:
        run = torch.compile(layer, backend=nv.backend(recipe=RNE, compiler="aot_eager"), fullgraph=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        y = run(x, ids, p)
    y.backward(dy)
    rows = slice(ctx.rank * T, (ctx.rank + 1) * T)
    same(y, y_all[rows], "Y")
    same(x.grad, x_all.grad[rows], "dX")
    same(p.grad, p_all.grad[rows], "dprob")
    same(layer.experts.fc1_weight.grad, full.fc1_weight.grad[mine], "dW1")
    same(layer.experts.fc2_weight.grad, full.fc2_weight.grad[mine], "dW2")
    if compiled:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 1 and sites_rewritten() == 1, f"{graphs} graphs, {sites_rewritten()} sites; expected 1, 1"
        return "Y, dX, dprob, dW1, dW2 bitwise; 1 graph, 1 site"
    return "Y, dX, dprob, dW1, dW2 bitwise"


def ep_eager(ctx):
    return _ep(ctx, compiled=False)


def ep_one_graph(ctx):
    return _ep(ctx, compiled=True)


def ep_fsdp2(ctx: Context) -> str:
    """Expert parallelism inside FSDP2, the layout of large MoE training: a (dp, ep) mesh of
    2 x world/2 ranks; each row of it is an expert-parallel group holding every expert once
    (all-to-all within the row), and FSDP2 shards each rank's local experts over its column
    (the ranks holding the same experts), reducing their gradients there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp = 2
    ep = ctx.world // dp
    assert ep * dp == ctx.world and G % ep == 0, f"world size {ctx.world}: needs 2 x a divisor of the {G} experts"
    mesh = init_device_mesh(ctx.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    row, col = ctx.rank // ep, ctx.rank % ep  # my ep group, my place in it
    torch.manual_seed(0)
    full = nv.GroupedMLP(G, H, F, recipe=RNE, device=ctx.device)
    layer = ExpertParallelMoE(G, H, F, RNE, ctx.device, group=mesh.get_group("ep"))
    mine = slice(col * layer.local, (col + 1) * layer.local)
    with torch.no_grad():
        layer.experts.fc1_weight.copy_(full.fc1_weight[mine])
        layer.experts.fc2_weight.copy_(full.fc2_weight[mine])
    fully_shard(layer.experts, mesh=mesh["dp"])

    # Single process: each ep group's tokens through all G experts; the weight gradients of
    # the dp groups summed and divided by dp (as FSDP2 reduces them; 2 terms, so no order).
    grads, ours = [], None
    for group_row in range(dp):
        ranks = range(group_row * ep, (group_row + 1) * ep)
        x_all, ids_all, p_all, dy_all = (torch.cat(parts) for parts in zip(*(tokens(r, ctx.device) for r in ranks)))
        x_all.requires_grad_(), p_all.requires_grad_()
        full.zero_grad()
        order = torch.argsort(ids_all, stable=True)
        y_all = full(x_all[order], torch.bincount(ids_all, minlength=G), p_all[order])[torch.argsort(order)]
        y_all.backward(dy_all)
        grads.append((full.fc1_weight.grad[mine].clone(), full.fc2_weight.grad[mine].clone()))
        if group_row == row:
            rows = slice(col * T, (col + 1) * T)
            ours = (y_all[rows], x_all.grad[rows], p_all.grad[rows])

    x, ids, p, dy = tokens(ctx.rank, ctx.device)
    x.requires_grad_(), p.requires_grad_()
    fresh_counters()
    layer.compile(backend=nv.backend(recipe=RNE, compiler="aot_eager"))  # after fully_shard
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        y = layer(x, ids, p)
    y.backward(dy)
    dw1, dw2 = layer.experts.fc1_weight.grad.full_tensor(), layer.experts.fc2_weight.grad.full_tensor()
    same(y, ours[0], "Y")
    same(x.grad, ours[1], "dX")
    same(p.grad, ours[2], "dprob")
    same(dw1, (grads[0][0] + grads[1][0]) / dp, "dW1")
    same(dw2, (grads[0][1] + grads[1][1]) / dp, "dW2")
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    assert sites_rewritten() == 1, f"{sites_rewritten()} sites rewritten, expected 1"
    return f"(dp, ep) = ({dp}, {ep}): Y, dX, dprob, dW1, dW2 bitwise; {graphs} graphs, 1 site"


def transformers_ep_fsdp2(ctx: Context) -> str:
    """transformers' own expert parallelism and FSDP2 (``DistributedConfig(ep_size=W,
    fsdp_size=W)``: its all-to-all token dispatch, expert weights as DTensors): a one-layer
    Qwen3-MoE loaded that way and compiled whole; its grouped MLP is rewritten inside
    transformers' expert-parallel path, and compare() finds every output and gradient (each
    rank's shards) bitwise equal to the eager NVFP4 chain."""
    import warnings

    import library_models as lib
    import transformers
    from transformers.distributed import DistributedConfig

    path = os.path.join(ctx.out, "qwen3_moe")
    if ctx.rank == 0:
        lib.tiny_causal_lm("qwen3_moe").save_pretrained(path)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(ep_size=ctx.world, fsdp_size=ctx.world),
            experts_implementation="grouped_mm", dtype=BF16,
            device_map=ctx.device,  # used at world size 1 only (its mesh places a larger world)
            use_kernels=False)  # else on CUDA (transformers >= 5.25) layers fetch hub kernels, over the network
    model.train()
    report = nv.compare(lib.Logits(model), backend=nv.backend(compiler="aot_eager"))(
        lib.input_ids(seed=ctx.rank).to(ctx.device))
    assert report.sites == 1 and report.bitwise, str(report)
    unchecked = [r.name for r in report.rows if r.note]
    assert not unchecked, f"not compared: {unchecked}"
    weight = model.model.layers[0].mlp.experts.gate_up_proj  # a DTensor where W > 1
    local = (weight.to_local() if ctx.world > 1 else weight).shape[0]
    return f"{len(report.rows)} outputs and gradients bitwise; 1 site; {local} of 4 experts a rank"


# ----------------------------------------------------------------------------- DTensor


def _distributed_mlp(ctx, placement, recipe):
    """A GroupedMLP of G experts whose weights are DTensors with `placement`, and its plain twin."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    plain = nv.GroupedMLP(G, H, F, recipe=recipe, device=ctx.device)
    mlp = nv.GroupedMLP(G, H, F, recipe=recipe, device=ctx.device)
    for name in ("fc1_weight", "fc2_weight"):
        setattr(mlp, name, nn.Parameter(distribute_tensor(getattr(plain, name).detach(), ctx.mesh, [placement])))
    return mlp, plain


def _step(fn, x, sizes, probs, dy, seed=STEP_SEED):
    torch.manual_seed(seed)
    y = fn(x, sizes, probs)
    y.backward(dy)
    return y


def _grads(fn, x, sizes, probs, dy):
    """(Y, dX, dprobs) of one step with the step's seed."""
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = _step(fn, x, sizes, probs, dy)
    return y, x.grad, probs.grad


def dtensor_shard0(ctx):
    from torch.distributed.tensor import DTensor, Shard

    mlp, plain = _distributed_mlp(ctx, Shard(0), SR_SINGLE)
    local = G // ctx.world
    mine = slice(ctx.rank * local, (ctx.rank + 1) * local)
    twin = nv.GroupedMLP(local, H, F, recipe=SR_SINGLE, device=ctx.device)  # the local run
    with torch.no_grad():
        twin.fc1_weight.copy_(plain.fc1_weight[mine])
        twin.fc2_weight.copy_(plain.fc2_weight[mine])
    x, _, p, dy = tokens(ctx.rank, ctx.device)
    sizes = torch.tensor([T // 3, T - T // 3] if local == 2 else [T // local] * local, device=ctx.device)
    expected = _grads(twin, x, sizes, p, dy)
    for compiled in (False, True):
        fresh_counters()
        mlp.zero_grad()
        fn = torch.compile(mlp, backend=nv.backend(recipe=SR_SINGLE, compiler="aot_eager")) if compiled else mlp
        how = "compiled" if compiled else "eager"
        for label, a, b in zip(("Y", "dX", "dprobs"), _grads(fn, x, sizes, p, dy), expected):
            same(a, b, f"{how} {label}")
        for name in ("fc1_weight", "fc2_weight"):
            grad = getattr(mlp, name).grad
            assert isinstance(grad, DTensor) and tuple(grad.placements) == (Shard(0),), f"{how} {name}.grad: {grad!r}"
            same(grad.to_local(), getattr(twin, name).grad, f"{how} d{name}")
        if compiled:
            assert sites_rewritten() == 1, f"{sites_rewritten()} sites rewritten, expected 1"
    return "eager and compiled == the local run; weight grads Shard(0) DTensors; 1 site"


def dtensor_replicate(ctx):
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    x, _, p, dy = tokens(0, ctx.device)  # replicated: every rank the same values
    sizes = torch.tensor([10, 0, 22, T - 32], device=ctx.device)

    def replicated(t):
        return distribute_tensor(t, ctx.mesh, [Replicate()])

    details = []
    for recipe in (RNE, SR_SINGLE):
        mlp, plain = _distributed_mlp(ctx, Replicate(), recipe)
        expected = _grads(plain, x, sizes, p, dy)
        for compiled in (False, True):
            from torch._dynamo.utils import counters

            fresh_counters()
            fn = torch.compile(mlp, backend=nv.backend(recipe=recipe, compiler="aot_eager")) if compiled else mlp
            mlp.zero_grad()
            got = _grads(fn, replicated(x), replicated(sizes), replicated(p), replicated(dy))
            how = f"{'compiled' if compiled else 'eager'} {'SR' if recipe.stochastic_rounding else 'RNE'}"
            for label, a, b in zip(("Y", "dX", "dprobs"), got, expected):
                assert isinstance(a, DTensor) and a.placements == (Replicate(),), f"{how} {label}: {a!r}"
                same(a.to_local(), b, f"{how} {label}")
            for name in ("fc1_weight", "fc2_weight"):
                same(getattr(mlp, name).grad.to_local(), getattr(plain, name).grad, f"{how} d{name}")
            if compiled:
                assert counters["nvfp4"]["sites_rejected"] == 1 and sites_rewritten() == 0, dict(counters["nvfp4"])
    details.append("RNE and SR (sr_per_rank=False), eager and compiled (site rejected) == plain run")
    mlp, _ = _distributed_mlp(ctx, Replicate(), nv.Recipe())
    try:
        mlp(replicated(x), replicated(sizes), replicated(p))
        raise AssertionError("SR with sr_per_rank=True on Replicate DTensors did not raise")
    except ValueError as err:
        assert "sr_per_rank" in str(err), str(err)
        details.append("SR with sr_per_rank raises")
    return "; ".join(details)


def dtensor_rejections(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x, _, p, _ = tokens(0, ctx.device)
    sizes = torch.tensor([10, 0, 22, T - 32], device=ctx.device)
    checks = []

    def raises(label, fn, *needles):
        try:
            fn()
        except ValueError as err:
            missing = [n for n in needles if n not in str(err)]
            assert not missing, f"{label}: {missing} not in the error: {err}"
            checks.append(label)
            return
        raise AssertionError(f"{label}: no ValueError")

    # Rows sharded (x Shard(0)): no strategy; the error names x.
    mlp, _ = _distributed_mlp(ctx, Replicate(), RNE)
    rep = lambda t: distribute_tensor(t, ctx.mesh, [Replicate()])  # noqa: E731
    raises("x Shard(0)", lambda: mlp(distribute_tensor(x, ctx.mesh, [Shard(0)]), rep(sizes), rep(p)), "x is a DTensor",
           "Replicate")
    # Experts sharded over features with local rows: the error names fc1_weight.
    mlp, _ = _distributed_mlp(ctx, Shard(1), RNE)
    raises("weights Shard(1)", lambda: mlp(x, sizes, p), "fc1_weight", "Shard(0)")
    # A DTensor weight with a plain x: names both.
    mlp, _ = _distributed_mlp(ctx, Replicate(), RNE)
    raises("mixed", lambda: mlp(x, sizes, p), "fc1_weight", "x")
    # A public quantizer on a Replicate DTensor: SR needs sr_per_rank=False.
    raises("group_quantize SR", lambda: nv.group_quantize(rep(x), rep(sizes), stochastic_rounding=True),
           "sr_per_rank")
    torch.manual_seed(STEP_SEED)
    q = nv.group_quantize(rep(x), rep(sizes), columnwise=True, stochastic_rounding=True, sr_per_rank=False)
    torch.manual_seed(STEP_SEED)
    expected = nv.group_quantize(x, sizes, columnwise=True, stochastic_rounding=True, sr_per_rank=False)
    same(q.columnwise_data.to_local(), expected.columnwise_data, "group_quantize on Replicate, SR codes")
    checks.append("group_quantize on Replicate DTensors")

    # A grouped_mm spelling with DTensor weights: explain says why it was not rewritten, and
    # the compiled run equals the eager one (stock PyTorch ops on DTensors).
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            w1 = torch.randn(G, F, H).mul(H ** -0.5).to(ctx.device, BF16)
            w2 = torch.randn(G, H, F).mul(F ** -0.5).to(ctx.device, BF16)
            self.w1 = nn.Parameter(distribute_tensor(w1, ctx.mesh, [Replicate()]))
            self.w2 = nn.Parameter(distribute_tensor(w2, ctx.mesh, [Replicate()]))

        def forward(self, x, offs):
            h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(torch.relu(h) ** 2, self.w2.transpose(-2, -1), offs=offs)

    experts = Experts()
    offs = rep(torch.cumsum(sizes, 0, dtype=torch.int32))
    report = nv.explain(experts)(rep(x), offs)
    reasons = [r[-1] for r in report.rejected]
    assert not report.sites and len(reasons) == 1 and "x is a DTensor" in reasons[0], str(report)
    checks.append(f"explain: {reasons[0][:50]}...")
    fresh_counters()
    compiled = torch.compile(experts, backend=nv.backend(compiler="aot_eager"))(rep(x), offs)
    same(compiled.to_local(), experts(rep(x), offs).to_local(), "grouped_mm on DTensors, compiled vs eager")

    # nvfp4::quantize_weights maps a Shard(0) expert stack to Shard(0) outputs.
    w = torch.randn(G, F, H).to(ctx.device, BF16)
    sharded = torch.ops.nvfp4.quantize_weights(distribute_tensor(w, ctx.mesh, [Shard(0)]), True)
    plain = torch.ops.nvfp4.quantize_weights(w, True)
    mine = slice(ctx.rank * (G // ctx.world), (ctx.rank + 1) * (G // ctx.world))
    for i, (a, b) in enumerate(zip(sharded, plain)):
        assert a.placements == (Shard(0),), a
        same(a.to_local(), b[mine], f"quantize_weights output {i}, this rank's experts")
    checks.append("quantize_weights Shard(0)")
    return "; ".join(checks)


# ----------------------------------------------------------------------------- stochastic rounding


def sr_ranks(ctx):
    """Every collective runs before any assertion, so a check failing on one rank cannot
    leave the others waiting in a collective."""
    rank, world = ctx.rank, ctx.world
    labels = ("dX", "dprobs", "dW1", "dW2")
    # The rule, in its one place: seed ^ (rank << 32); rank 0 keeps the single-process seed.
    torch.manual_seed(11)
    drawn = int(draw_seed())
    torch.manual_seed(11)
    folded = int(draw_seed(per_rank=True))

    # Bits of one SR quantization of the same tensor on every rank, seeded alike.
    x, _, p, dy = tokens(0, ctx.device)
    sizes = torch.tensor([16, 0, 20, T - 36], device=ctx.device)

    def codes(per_rank):
        torch.manual_seed(STEP_SEED)
        q = nv.group_quantize(x, sizes, columnwise=True, rht=True, stochastic_rounding=True, sr_per_rank=per_rank)
        return torch.cat([q.rowwise_data.reshape(-1), q.columnwise_data.reshape(-1)])

    # Gradients of a GroupedMLP step with SR (default recipe, then sr_per_rank=False).
    def step(recipe, compiled=False):
        torch.manual_seed(0)
        mlp = nv.GroupedMLP(G, H, F, recipe=recipe, device=ctx.device)
        fn = mlp
        if compiled:
            fresh_counters()
            fn = torch.compile(mlp, backend=nv.backend(recipe=recipe, compiler="aot_eager"))
        _, dx, dp = _grads(fn, x, sizes, p, dy)
        return [dx, dp, mlp.fc1_weight.grad, mlp.fc2_weight.grad]

    first, again, shared = codes(True), codes(True), codes(False)
    eager, twice, compiled, unfolded = step(nv.Recipe()), step(nv.Recipe()), step(nv.Recipe(), True), step(SR_SINGLE)
    codes_per_rank, codes_shared = gather_bytes(first, world), gather_bytes(shared, world)
    dx_per_rank, dx_shared = gather_bytes(eager[0], world), gather_bytes(unfolded[0], world)

    checks = []
    assert folded == drawn ^ (rank << 32), f"rank {rank}: draw_seed(per_rank=True) != seed ^ (rank << 32)"
    checks.append("seed ^ (rank << 32)")
    same(again, first, "SR codes, run twice")
    if world > 1:
        assert not torch.equal(codes_per_rank[0], codes_per_rank[1]), "ranks 0 and 1 drew identical SR bits"
        differ = int((codes_per_rank[0] != codes_per_rank[1]).sum())
        checks.append(f"ranks 0/1 codes differ in {differ} of {first.numel()} bytes")
    assert all(torch.equal(c, codes_shared[0]) for c in codes_shared), "sr_per_rank=False: ranks drew different bits"
    checks.append("sr_per_rank=False: equal codes")
    for label, a, b, c in zip(labels, twice, compiled, eager):
        same(a, c, f"SR {label}, run twice")
        same(b, c, f"SR {label}, compiled vs eager on rank {rank}")
    checks.append("SR grads reproducible, compiled == eager per rank")
    if rank == 0:
        for label, a, b in zip(labels, eager, unfolded):
            same(a, b, f"rank 0 {label}: sr_per_rank on vs off")
    if world > 1:
        assert not torch.equal(dx_per_rank[0], dx_per_rank[1]), "ranks 0 and 1 got identical SR gradients"
        checks.append("dX differs across ranks")
    assert all(torch.equal(d, dx_shared[0]) for d in dx_shared), "sr_per_rank=False: ranks got different dX"
    checks.append("sr_per_rank=False: equal dX")
    return "; ".join(checks)


# ----------------------------------------------------------------------------- worker


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="*")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    ctx = Context(args.device, args.out)
    names = args.scenarios or SCENARIOS
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "detail": globals()[name](ctx)}
        except Exception as err:  # reported back, the next scenario still runs
            results[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        pathlib.Path(args.out, f"rank{ctx.rank}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
