"""Question: does a small MoE language model trained with ``backend="nvfp4"`` learn like
the same model in BF16, and what does each part of the recipe contribute?

The model is written as a user would write it, in plain PyTorch: byte embedding plus a
learned position embedding, pre-norm blocks of causal attention
(``F.scaled_dot_product_attention``) and an MoE layer in the token-permutation
``torch._grouped_mm`` form (softmax top-k router whose normalised probabilities multiply
the expert output, offsets from ``torch.histc`` of the sorted expert ids: no host sync,
SwiGLU experts stored (E, out, in)), RMSNorm, an untied LM head, and a Switch-style
load-balancing loss (coefficient ``--aux``). Parameters are bf16 and AdamW runs on them
directly (bf16 weights and optimizer state, no fp32 master copy): the simplest honest
set-up, the same for every run.

Data: the running Python's standard library ``.py`` files (``sysconfig``'s stdlib
directory, ``site-packages`` excluded), sorted by path, read as bytes (vocabulary 256);
every 20th file is held out for validation. The byte counts are printed at the start (they
depend on the Python version). Every run draws the same training windows from its own
generator (``--seed``) and the same parameter initialisation; validation uses fixed
windows. On CUDA every run uses ``torch.use_deterministic_algorithms(True, warn_only=True)``
(``--nondeterministic`` turns it off), so that nvfp4 vs nvfp4_save_d compares the blocks and
not the atomics of the embedding or attention backward.

Runs (``--runs``, any subset):
  bf16         torch.compile with stock Inductor, BF16 everywhere
  nvfp4        backend="nvfp4", default Recipe (RHT, SR on gradients, 16x16 weight tiles), recompute on
  nvfp4_save_d the same with recompute off (D saved): must be bit-identical to nvfp4
  no_rht       Recipe(rht=False)
  no_sr        Recipe(stochastic_rounding=False)
  w1x16        Recipe(block_2d=False): weights in 1x16 blocks like activations
  last_bf16    default recipe, the last MoE layer kept in BF16 (nv.Precision(last_moe_layers_bf16=1))

    PYTHONPATH=. python benchmarks/convergence.py [--steps N] [--layers L] [--hidden H]
        [--experts E] [--runs bf16 nvfp4 ...] [--seeds 0 1 2] [--device cuda] [--out results/convergence]
    PYTHONPATH=. python benchmarks/convergence.py --from-json a.json b.json --out ...   # merge, table, plot

Output: a table (train loss as the mean of the last 20 steps, final validation loss, its
gap relative to the bf16 run of the same seed, tokens/s of the training steps after the first),
``<out>.json`` with the curves, and ``<out>.png`` when matplotlib is importable (``pip install
matplotlib``). Every result records its ``seed``; a merge of JSONs from different seeds keeps
the runs apart (run names get " s<seed>" in the table, ", seed <seed>" in the plot, one line
style per seed and a third panel of the final validation losses by run and seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import nvfp4_inductor as nv

BF16 = torch.bfloat16

RUNS = {  # name -> (label, recipe kwargs or None for bf16, recompute)
    "bf16": ("BF16, stock Inductor", None, True),
    "nvfp4": ("NVFP4, default recipe", {}, True),
    "nvfp4_save_d": ("NVFP4, recompute off", {}, False),
    "no_rht": ("NVFP4, no RHT", {"rht": False}, True),
    "no_sr": ("NVFP4, no stochastic rounding", {"stochastic_rounding": False}, True),
    "w1x16": ("NVFP4, 1x16 weight blocks", {"block_2d": False}, True),
    "last_bf16": ("NVFP4, last MoE layer in BF16", {}, True),
}
PRECISION = {"last_bf16": dict(last_moe_layers_bf16=1)}  # run -> nv.Precision's arguments


# ----------------------------------------------------------------------------- data


def load_corpus(max_files=None, val_every=20):
    """(train bytes, validation bytes, info): the stdlib's .py files sorted by path, every
    `val_every`-th file to validation. `max_files` keeps the first files only (tests)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file())
    if max_files is not None:
        files = files[:max_files]
    train, val = bytearray(), bytearray()
    for i, f in enumerate(files):
        (val if i % val_every == 0 else train).extend(f.read_bytes())
    info = {"root": str(root), "files": len(files), "train_bytes": len(train), "val_bytes": len(val),
            "python": sys.version.split()[0]}
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), info


def train_batches(data, batch, seq, seed):
    """Endless (x, y) windows drawn from a generator of their own: same order in every run."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)
        w = data[idx].long()
        yield w[:, :-1], w[:, 1:]


def val_batches(data, batch, seq, count):
    """`count` fixed batches of windows spread evenly over the validation bytes."""
    n = batch * count
    starts = torch.linspace(0, len(data) - seq - 2, n).long()
    w = data[starts[:, None] + torch.arange(seq + 1)].long()
    return [(w[i * batch:(i + 1) * batch, :-1], w[i * batch:(i + 1) * batch, 1:]) for i in range(count)]


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass
class Config:
    layers: int = 4
    hidden: int = 384
    heads: int = 6
    experts: int = 8
    top_k: int = 2
    ffn: int = 768       # per expert; SwiGLU's fc1 is 2 * ffn wide
    seq: int = 256
    vocab: int = 256


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False, dtype=BF16)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False, dtype=BF16)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MoE(nn.Module):
    """Softmax top-k router + SwiGLU experts in the token-permutation grouped_mm form."""

    def __init__(self, cfg):
        super().__init__()
        self.experts, self.top_k = cfg.experts, cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False, dtype=BF16)
        self.w13 = nn.Parameter(torch.empty(cfg.experts, 2 * cfg.ffn, cfg.hidden, dtype=BF16))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn, dtype=BF16))

    def forward(self, x):
        """x: (T, H) -> (out (T, H), load-balancing loss)."""
        scores = F.softmax(self.router(x).float(), dim=-1)
        top, ids = torch.topk(scores, self.top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        flat_ids = ids.reshape(-1)
        perm = torch.argsort(flat_ids, stable=True)
        ids_g = flat_ids[perm]
        token_idx = perm // self.top_k
        counts = torch.histc(ids_g.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x[token_idx], self.w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)
        y = y * top.reshape(-1)[perm].to(y.dtype).unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, token_idx, y)
        balance = self.experts * (counts / ids_g.numel() * scores.mean(0)).sum()
        return out, balance


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, dtype=BF16)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden, dtype=BF16)
        self.moe = MoE(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        y, balance = self.moe(self.norm2(x).flatten(0, 1))
        return x + y.view_as(x), balance


class MoELM(nn.Module):
    """Byte-level MoE language model; forward(idx, targets) -> (cross-entropy, balance loss)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden, dtype=BF16)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden, dtype=BF16)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, dtype=BF16)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=BF16)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        out_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0)  # norm weights
            elif name.endswith(("proj.weight", "w2")) and "qkv" not in name:
                p.copy_(torch.randn(p.shape) * out_std)
            else:
                p.copy_(torch.randn(p.shape) * 0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        balance = 0.0
        for block in self.blocks:
            x, b = block(x)
            balance = balance + b
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), balance / len(self.blocks)


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass
class TrainConfig:
    steps: int = 600
    batch: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    aux: float = 0.01
    clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    compiler: str = "inductor"  # "inductor" or "aot_eager" (both runs kinds)


def lr_at(step, tc):
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_model(cfg, seed, device):
    torch.manual_seed(seed)
    return MoELM(cfg).to(device)


def compile_model(model, run, compiler):
    _, recipe, recompute = RUNS[run]
    if recipe is None:
        return torch.compile(model, backend=compiler)
    return torch.compile(model, backend=nv.backend(recipe=nv.Recipe(**recipe), recompute=recompute,
                                                      compiler=compiler,
                                                      precision=nv.Precision(**PRECISION.get(run, {}))))


def explain_sites(cfg, device, batch=2):
    """Grouped MLPs the nvfp4 backend finds in the model (expected: one per layer)."""
    model = build_model(cfg, 0, device)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=device)
    return nv.explain(model)(idx, idx)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_run(run, cfg, tc, train, val, device="cpu", progress=True):
    """Train one run from scratch. Returns (result dict, trained model)."""
    torch._dynamo.reset()  # fresh compile per run (backends differ; the recompile limit)
    model = build_model(cfg, tc.seed, device)
    compiled = compile_model(model, run, tc.compiler)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    batches = train_batches(train, tc.batch, cfg.seq, tc.seed + 1)
    vals = val_batches(val, tc.batch, cfg.seq, tc.eval_batches)
    torch.manual_seed(tc.seed + 2)  # the stochastic-rounding seeds are drawn from here, in step order

    def evaluate():
        with torch.no_grad():
            return sum(compiled(x.to(device), y.to(device))[0].item() for x, y in vals) / len(vals)

    bar = _progress(tc.steps, RUNS[run][0]) if progress else None
    train_curve, val_curve, timed, timed_tokens = [], [], 0.0, 0
    for step in range(tc.steps):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        _sync(device)
        t0 = time.perf_counter()
        ce, balance = compiled(x, y)
        (ce + tc.aux * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = ce.item()  # syncs
        if step > 0:
            timed += time.perf_counter() - t0
            timed_tokens += x.numel()
        train_curve.append(loss)
        if not math.isfinite(loss):
            if bar:
                bar.close()
            break
        if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
            val_curve.append((step + 1, evaluate()))
        if bar:
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.3f}" + (f" val {val_curve[-1][1]:.3f}" if val_curve else ""))
    if bar:
        bar.close()
    result = {"run": run, "label": RUNS[run][0], "seed": tc.seed, "train": train_curve, "val": val_curve,
              "tokens_per_s": timed_tokens / timed if timed else float("nan"),
              "final_train": _tail_mean(train_curve), "final_val": val_curve[-1][1] if val_curve else float("nan")}
    return result, model


def _tail_mean(curve, n=20):
    tail = curve[-n:]
    return sum(tail) / len(tail) if tail else float("nan")


def _progress(total, desc):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=f"{desc:<30}", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return _LineProgress(total, desc)


class _LineProgress:
    """A one-line progress printer for when tqdm is not installed."""

    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.post, self.t0 = total, desc, 0, "", time.perf_counter()

    def update(self, k):
        self.n += k
        print(f"\r{self.desc}: {self.n}/{self.total} {time.perf_counter() - self.t0:.0f}s {self.post}",
              end="", file=sys.stderr, flush=True)

    def set_postfix_str(self, s):
        self.post = s

    def close(self):
        print(file=sys.stderr)


# ----------------------------------------------------------------------------- report


def seeds_of(results):
    """The seeds the results were trained with, sorted (a result without one counts as None)."""
    return sorted({r.get("seed") for r in results}, key=lambda s: (s is None, s))


def run_name(r, multi_seed):
    return f"{r['run']} s{r.get('seed')}" if multi_seed else r["run"]


def table(results):
    """One row per result; the gap is against the first bf16 result of the same seed."""
    from nvfp4_inductor.inspection import format_table
    multi = len(seeds_of(results)) > 1
    bases = {}
    for r in results:
        if r["run"] == "bf16":
            bases.setdefault(r.get("seed"), r)
    rows = []
    for r in results:
        base = bases.get(r.get("seed"))
        gap = (f"{100 * (r['final_val'] / base['final_val'] - 1):+.2f}%" if base and r is not base else
               ("-" if r is base else "n/a"))
        bits = {True: "yes", False: "NO"}.get(r.get("bitwise_equal_to_nvfp4"), "")
        rows.append([run_name(r, multi), r["label"], f"{r['final_train']:.4f}", f"{r['final_val']:.4f}", gap,
                     f"{r['tokens_per_s']:,.0f}", bits])
    return format_table(["run", "what", "train (last 20 steps)", "final val", "val vs bf16", "tokens/s",
                         "bitwise == nvfp4"], rows)


def summary(results):
    """Per run over its seeds: the mean final validation loss, its spread (max - min) and
    the mean gap to BF16; and whether the recipes separate: each gap larger than BF16's own
    spread across seeds (None with one seed)."""
    from nvfp4_inductor.inspection import format_table
    finals = {}
    for r in results:
        finals.setdefault(r["run"], []).append(r["final_val"])
    if len(seeds_of(results)) < 2 or "bf16" not in finals:
        return None, None
    bf16 = sum(finals["bf16"]) / len(finals["bf16"])
    spread = {run: max(v) - min(v) for run, v in finals.items()}
    rows, separate = [], True
    for run, values in finals.items():
        mean = sum(values) / len(values)
        gap = mean - bf16
        if run != "bf16":
            separate &= abs(gap) > spread["bf16"]
        rows.append([run, len(values), f"{mean:.4f}", f"{spread[run]:.4f}",
                     "-" if run == "bf16" else f"{100 * gap / bf16:+.2f}%"])
    text = format_table(["run", "seeds", "mean final val", "spread (max - min)", "mean vs bf16"], rows)
    verdict = (f"BF16's spread across seeds is {spread['bf16']:.4f} ({100 * spread['bf16'] / bf16:.2f}%): the runs "
               + ("separate (every mean gap is larger)" if separate else "do not separate at this length"))
    return text, verdict


def plot(results, path, title):
    """PNG of the train (smoothed) and validation curves; None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    seeds = seeds_of(results)
    multi = len(seeds) > 1
    fig, axes = plt.subplots(1, 3 if multi else 2, figsize=(18 if multi else 12, 4.5))
    ax_t, ax_v = axes[:2]
    colors = {}  # one colour per run name, one line style per seed
    styles = ["-", "--", ":", "-."]
    shown = [r for r in results if r["run"] != "nvfp4_save_d"]  # bit-identical to nvfp4 when it passes
    for r in shown:
        color = colors.setdefault(r["run"], f"C{len(colors) % 10}")
        style = styles[seeds.index(r.get("seed")) % len(styles)]
        label = f"{r['label']}, seed {r.get('seed')}" if multi else r["label"]
        k = max(1, len(r["train"]) // 50)
        smooth = [sum(r["train"][max(0, i - k + 1):i + 1]) / len(r["train"][max(0, i - k + 1):i + 1])
                  for i in range(len(r["train"]))]
        ax_t.plot(range(1, len(smooth) + 1), smooth, label=label, lw=1.2, color=color, ls=style)
        if r["val"]:
            s, v = zip(*r["val"])
            ax_v.plot(s, v, marker="o", ms=3, label=label, lw=1.2, color=color, ls=style)
    ax_t.set(title=f"train loss (moving mean of {k})", xlabel="step", ylabel="nats / byte")
    ax_v.set(title="validation loss", xlabel="step", ylabel="nats / byte")
    if multi:  # the seed spread next to the gaps between runs
        ax_f = axes[2]
        names = list(colors)
        markers = ["o", "s", "^", "D"]
        for i, seed in enumerate(seeds):
            pts = [(names.index(r["run"]), r["final_val"]) for r in shown if r.get("seed") == seed]
            if pts:
                x, y = zip(*pts)
                ax_f.scatter(x, y, marker=markers[i % len(markers)], s=40, c=[colors[names[j]] for j in x])
            ax_f.scatter([], [], marker=markers[i % len(markers)], c="k", label=f"seed {seed}")
        ax_f.set_xticks(range(len(names)), names)
        ax_f.set(title="final validation loss by run and seed", ylabel="nats / byte")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bitwise_equal(res_a, model_a, res_b, model_b):
    return res_a["train"] == res_b["train"] and res_a["val"] == res_b["val"] and all(
        torch.equal(p, q) for p, q in zip(model_a.state_dict().values(), model_b.state_dict().values()))


def _write_json(out, meta, results):
    pathlib.Path(f"{out}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--seq", type=int, default=Config.seq)
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--hidden", type=int, default=Config.hidden)
    ap.add_argument("--heads", type=int, default=Config.heads)
    ap.add_argument("--experts", type=int, default=Config.experts)
    ap.add_argument("--top-k", type=int, default=Config.top_k)
    ap.add_argument("--ffn", type=int, default=Config.ffn)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--warmup", type=int, default=TrainConfig.warmup)
    ap.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    ap.add_argument("--eval-batches", type=int, default=TrainConfig.eval_batches)
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="run every run for each of these seeds")
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-files", type=int, default=None, help="use the first N stdlib files only")
    ap.add_argument("--out", default="benchmarks/results/convergence", help="writes <out>.json and <out>.png")
    ap.add_argument("--from-json", nargs="+", default=None, help="merge these result JSONs; no training")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--nondeterministic", action="store_true",
                    help="on CUDA, leave torch's nondeterministic kernels on (by default every run uses\n"
                         "torch.use_deterministic_algorithms(True, warn_only=True), so that the recompute\n"
                         "on == off check is about the nvfp4 blocks, not about atomics in the embedding or\n"
                         "attention backward)")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not a.nondeterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        torch.use_deterministic_algorithms(True, warn_only=True)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    if a.from_json:
        docs = [json.loads(pathlib.Path(p).read_text()) for p in a.from_json]
        for d in docs:  # results written before they recorded their seed: the file's seed
            for r in d["results"]:
                r.setdefault("seed", d["meta"]["train"]["seed"])
        results = [r for d in docs for r in d["results"]]
        meta = docs[0]["meta"]
        meta["merged_from"] = a.from_json
        if len(seeds_of(results)) > 1:
            meta["seeds"] = seeds_of(results)  # meta["train"] is the first file's
    else:
        cfg = Config(layers=a.layers, hidden=a.hidden, heads=a.heads, experts=a.experts, top_k=a.top_k,
                     ffn=a.ffn, seq=a.seq)
        tc = TrainConfig(steps=a.steps, batch=a.batch, lr=a.lr, warmup=min(a.warmup, max(1, a.steps // 10)),
                         eval_every=a.eval_every, eval_batches=a.eval_batches, seed=a.seed, compiler=a.compiler)
        train, val, info = load_corpus(a.max_files)
        print(f"corpus: {info['files']} stdlib .py files of Python {info['python']} under {info['root']}: "
              f"train {info['train_bytes']:,} bytes, validation {info['val_bytes']:,} bytes")
        print(f"model: {cfg}; {sum(p.numel() for p in MoELM(cfg).parameters()):,} parameters")
        print(f"training: {tc}; {tc.steps * tc.batch * cfg.seq:,} training tokens per run; device {a.device}")
        if any(RUNS[r][1] is not None for r in a.runs):
            report = explain_sites(cfg, a.device)
            print(f"explain: {len(report.sites)} grouped MLP(s) rewritten for {cfg.layers} MoE layers, "
                  f"{len(report.rejected)} rejected, {sum(b.times for b in report.graph_breaks)} graph break(s)")
            if len(report.sites) != cfg.layers:
                print(report)
                raise SystemExit("not every MoE layer was found")
        meta = {"corpus": info, "model": dataclasses.asdict(cfg), "train": dataclasses.asdict(tc),
                "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
                "torch": torch.__version__, "deterministic": torch.are_deterministic_algorithms_enabled(),
                "argv": sys.argv[1:] if argv is None else argv,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        results, models = [], {}
        seeds = a.seeds or [a.seed]
        if len(seeds) > 1:
            meta["seeds"] = seeds
        for seed, run in [(seed, run) for seed in seeds for run in a.runs]:
            if run == a.runs[0]:
                models = {}  # the bitwise check compares runs of one seed
            res, model = train_run(run, cfg, dataclasses.replace(tc, seed=seed), train, val, a.device,
                                   progress=not a.no_progress)
            results.append(res)
            if run in ("nvfp4", "nvfp4_save_d"):
                models[run] = (res, model)
            else:
                del model
            if len(models) == 2 and "bitwise_equal_to_nvfp4" not in models["nvfp4_save_d"][0]:
                models["nvfp4_save_d"][0]["bitwise_equal_to_nvfp4"] = bitwise_equal(*models["nvfp4"],
                                                                                    *models["nvfp4_save_d"])
            _write_json(out, meta, results)  # after every run: a run cut short keeps the finished ones
    print(table(results))
    text, verdict = summary(results)
    if text:
        print(text)
        print(verdict)
    _write_json(out, meta, results)
    m = meta["model"]
    title = (f"{m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts top-{m['top_k']}, "
             f"ffn {m['ffn']}, seq {m['seq']}; {meta['train']['steps']} steps x {meta['train']['batch']}; "
             f"{meta['device']}" + (f"; seeds {', '.join(map(str, meta['seeds']))}" if "seeds" in meta else ""))
    png = plot(results, f"{out}.png", title)
    print(f"wrote {out}.json" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    return results


if __name__ == "__main__":
    main()
