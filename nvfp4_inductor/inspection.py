"""Look inside and check: ``explain``, ``dump_code``, ``compare``.

Each compiles `fn` afresh (``torch._dynamo.reset()`` first, so nothing cached from an
earlier compile answers for it) and prints a table when printed.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Callable, Optional

import torch

from .compiler import backend as backend_mod
from .compiler.fused import describe_steps, saved_for_backward
from .compiler.options import BackendOptions
from .lowerings import get_target
from .recipe import Recipe


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in [headers] + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# explain


@dataclasses.dataclass
class SiteReport:
    location: str
    spelling: str
    activation: str
    target: str
    reason: str
    forward_steps: list[tuple[str, str]]  # (step, function that runs it)
    backward_steps: list[tuple[str, str]]
    saved: list[tuple[str, str, tuple, int]]  # (name, dtype, shape, bytes)
    specialisation: str = ""  # what Dynamo specialised the site's routing on
    estimated: bool = False  # saved bytes from size hints: some sizes are data-dependent

    @property
    def saved_bytes(self) -> int:
        return sum(b for *_, b in self.saved)


@dataclasses.dataclass
class ExplainReport:
    sites: list[SiteReport]
    rejected: list[tuple[str, str, str]]  # (location, spelling, reason)
    graph_breaks: list[str]
    graphs: int

    def __str__(self) -> str:
        out = [f"nvfp4 explain: {self.graphs} graph(s), {len(self.sites)} grouped MLP(s) rewritten, "
               f"{len(self.rejected)} rejected, {len(self.graph_breaks)} graph break(s)"]
        if self.sites:
            out.append(format_table(
                ["#", "site", "spelling", "activation", "target", "saved for bwd"],
                [[i, s.location, s.spelling, s.activation, s.target, _bytes(s.saved_bytes)]
                 for i, s in enumerate(self.sites)],
            ))
            for i, s in enumerate(self.sites):
                out.append(f"\nsite {i}: {s.reason}")
                if s.specialisation:
                    out.append(f"routing: {s.specialisation}")
                out.append(format_table(["forward step", "runs"], [list(step) for step in s.forward_steps]))
                out.append(format_table(["backward step", "runs"], [list(step) for step in s.backward_steps]))
                out.append(format_table(["saved tensor", "dtype", "shape", "bytes"],
                                        [[n, d, "x".join(map(str, sh)), _bytes(b)] for n, d, sh, b in s.saved]))
                if s.estimated:
                    out.append("(estimated: data-dependent sizes taken as their size hints, an unbacked "
                               "row count as torch._inductor.config.unbacked_symint_fallback)")
        if self.rejected:
            out.append("\nnot rewritten (run as stock Inductor would):")
            out.append(format_table(["site", "spelling", "reason"], [list(r) for r in self.rejected]))
        if self.graph_breaks:
            out.append("\ngraph breaks: Dynamo split the code, and what runs between the graphs is not compiled. "
                       "An expert loop broken this way (e.g. per-expert torch.where/nonzero on the routing) "
                       "runs its experts outside any graph, so they cannot be rewritten:")
            out.extend(f"  - {b}" for b in self.graph_breaks)
        return "\n".join(out)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _concrete(shape) -> tuple:
    return tuple(_size_hint(s)[0] for s in shape)


def _size_hint(size) -> tuple[int, bool]:
    """``(value, estimated)`` of a size: an int, a backed SymInt's hint, or for a
    data-dependent (unbacked) size Inductor's ``unbacked_symint_fallback`` for each unbacked
    symbol (no guard is taken; PITFALLS.md: unbacked sizes)."""
    if not isinstance(size, torch.SymInt):
        return int(size), False
    if size.node.hint is not None:
        return int(size.node.hint), False
    from torch._inductor.config import unbacked_symint_fallback
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    import sympy

    expr = size.node.expr
    expr = expr.xreplace({u: sympy.Integer(unbacked_symint_fallback) for u in free_unbacked_symbols(expr)})
    return int(expr if not expr.free_symbols else size.node.shape_env.size_hint(expr)), True


def _site_report(site, plan, call_node, options: BackendOptions) -> SiteReport:
    from .compiler.nodes import val

    x, w1, w2, sizes, probs = (None if a is None else val(a) for a in call_node.args[:5])
    kept = saved_for_backward(x, w1, w2, sizes, probs, activation=site.activation, recompute=options.recompute)
    saved = [
        (name, str(t.dtype).replace("torch.", ""), _concrete(t.shape), math.prod(_concrete(t.shape)) * t.element_size())
        for name, t in kept
    ]
    fwd, bwd = describe_steps(get_target(plan.target).steps(), plan, recompute=options.recompute,
                              rht=options.recipe.rht, stochastic_rounding=options.recipe.stochastic_rounding)
    estimated = any(_size_hint(d)[1] for _, t in kept for d in t.shape)
    return SiteReport(site.location, site.spelling, site.activation, plan.target, plan.reason, fwd, bwd, saved,
                      _specialisation(site), estimated)


def _specialisation(site) -> str:
    """What Dynamo specialised on for the site's group sizes (the expert loop's split
    sizes are Python values Dynamo guards on; tensor spellings keep them on the device)."""
    sizes = site.group_sizes
    if sizes.kind in ("offsets", "sizes") and site.spelling != "expert_loop":
        return "group sizes stay a device tensor: new routing, same T -> no recompile"
    if sizes.kind == "equal":
        return "equal groups of T/G rows: only T is part of the graph (dynamic after one recompile)"
    if sizes.kind == "sizes":
        return ("split sizes are counts[e].item() of a counts tensor (.tolist() under capture_scalar_outputs): "
                "unbacked SymInts, no recompile on new routing, but the .tolist() syncs the host every step")
    constants = [s for s in sizes.source if isinstance(s, int)]
    if len(constants) == len(sizes.source):
        return (f"Dynamo specialised on the split sizes {tuple(constants)} (Python ints): new routing "
                "recompiles once, then automatic dynamic shapes turn them into SymInts")
    return ("split sizes are backed SymInts (automatic dynamic shapes): Dynamo guards only on their "
            "0/1 specialisation, so new routing rarely recompiles; the sizes still come from the host")


def explain(fn: Callable, *args, recipe: Optional[Recipe] = None, recompute: bool = True, **kwargs) -> ExplainReport:
    """Compile `fn` with the nvfp4 backend, run it on `args`, and report every grouped MLP
    found (where, which spelling, target and why, the steps forward and backward, what is
    saved for backward) and every near-miss with the reason it was not rewritten."""
    options = BackendOptions.parse({"recipe": recipe or Recipe(), "recompute": recompute})
    reports: list[SiteReport] = []
    rejected: list[tuple[str, str, str]] = []
    graphs = 0

    def recording_backend(gm, example_inputs, **kw):
        nonlocal graphs
        graphs += 1
        record = backend_mod.rewrite_graph(gm, options)
        for (site, plan), node in zip(record.sites, record.call_nodes):
            reports.append(_site_report(site, plan, node, options))
        rejected.extend((r.location, r.spelling, r.reason) for r in record.rejections)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=recording_backend)(*args, **kwargs)
    torch._dynamo.reset()
    dynamo = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = [_describe_break(b) for b in dynamo.break_reasons]
    breaks += ["(reason not recorded by Dynamo)"] * max(0, dynamo.graph_break_count - len(breaks))
    torch._dynamo.reset()
    return ExplainReport(reports, rejected, breaks, graphs)


def _describe_break(reason) -> str:
    where = ""
    if getattr(reason, "user_stack", None):
        frame = reason.user_stack[-1]
        where = f" at {pathlib.Path(frame.filename).name}:{frame.lineno}"
    return f"{reason.reason.splitlines()[0]}{where}"


# ---------------------------------------------------------------------------------------
# dump_code


def dump_code(fn: Callable, *args, path, recipe: Optional[Recipe] = None, recompute: bool = True) -> list[pathlib.Path]:
    """Compile and run `fn` (forward, and backward when the output needs grad) under
    depyf, which writes the Dynamo graph, the forward/backward graphs and Inductor's
    generated code to `path`; returns the files written."""
    import depyf

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend_mod.backend(recipe=recipe, recompute=recompute))
    with depyf.prepare_debug(str(path)):
        out = compiled(*args)
        outs = [o for o in _flatten(out) if o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [_fixed_grad(o, i) for i, o in enumerate(outs)])
    torch._dynamo.reset()
    return sorted(p for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------
# compare


@dataclasses.dataclass
class CompareRow:
    name: str
    bitwise: bool
    max_ulps: int
    max_abs: float


@dataclasses.dataclass
class CompareReport:
    rows: list[CompareRow]
    surroundings: str

    @property
    def bitwise(self) -> bool:
        return all(r.bitwise for r in self.rows)

    def __str__(self) -> str:
        verdict = "BITWISE EQUAL" if self.bitwise else "DIFFERENT"
        table = format_table(["tensor", "bitwise", "max ulps", "max |diff|"],
                             [[r.name, "yes" if r.bitwise else "NO", r.max_ulps, f"{r.max_abs:.3g}"] for r in self.rows])
        return (f"nvfp4 compare (eager NVFP4 chain vs compiled nvfp4; ops outside the expert blocks: "
                f"{self.surroundings} vs Inductor): {verdict}\n{table}")


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return []


def _fixed_grad(t: torch.Tensor, index: int) -> torch.Tensor:
    """A fixed, non-trivial output gradient (not stride-0 ones), same for both runs."""
    g = torch.Generator().manual_seed(1234 + index)
    return torch.randn(t.shape, generator=g).to(t.dtype).to(t.device)


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as integers ordered like the floats, so differences count ulps."""
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    i = t.contiguous().view(int_dtype).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    return torch.where(i < 0, -(i + sign_bit), i)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (so -0.0 != 0.0 and NaNs compare by payload)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    if not a.is_floating_point():
        return int((a.long() - b.long()).abs().max())
    return int((_ordered_bits(a) - _ordered_bits(b)).abs().max())


def _run(fn, args, kwargs, backend, seed, grad_inputs):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    outs = _flatten(torch.compile(fn, backend=backend)(*args, **kwargs))
    diff = [o for o in outs if o.requires_grad]
    grads = []
    if diff and grad_inputs:
        grads = torch.autograd.grad(diff, [t for _, t in grad_inputs],
                                    [_fixed_grad(o, i) for i, o in enumerate(diff)], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def eager_semantics_backend(options: BackendOptions, surroundings: str):
    """Each recognised site replaced by the eager NVFP4 chain (``nvfp4_inductor.grouped_mlp``,
    op by op): the semantics compiled runs must match. The ops around the sites run
    eagerly (surroundings="eager") or through stock Inductor ("inductor")."""
    from .nn import grouped_mlp

    def site_call(site_options: BackendOptions, plan):  # the eager chain chooses the same target itself
        def nvfp4_eager_grouped_mlp(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation, tanh_clamp_scale):
            return grouped_mlp(x, fc1_weight, fc2_weight, group_sizes, probs, activation=activation,
                               tanh_clamp_scale=tanh_clamp_scale, recipe=site_options.recipe)

        return nvfp4_eager_grouped_mlp

    def eager_nvfp4(gm, example_inputs, **kw):
        backend_mod.rewrite_graph(gm, options, site_call=site_call)
        if surroundings == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    return eager_nvfp4


def compare(fn: Callable, *args, recipe: Optional[Recipe] = None, recompute: bool = True, seed: int = 0,
            surroundings: str = "eager", compiler: str = "inductor", **kwargs) -> CompareReport:
    """Run `fn` eagerly with NVFP4 semantics and compiled with the nvfp4 backend, forward
    and backward (fixed output gradients, same seed), and compare every output and every
    gradient (inputs that require grad, and parameters when `fn` is a module) bit for bit.

    surroundings: how the eager side runs the ops outside the expert blocks. "eager"
    (default) is plain eager PyTorch; Inductor may round fused bf16 chains there
    differently from eager (its own behaviour, not this backend's). "inductor" compiles
    them with stock Inductor on the eager side too, so only the blocks are compared.
    recipe / recompute / compiler: the backend's options for the compiled side."""
    if surroundings not in ("eager", "inductor"):
        raise ValueError(f"surroundings must be 'eager' or 'inductor'; got {surroundings!r}")
    options = BackendOptions.parse({"recipe": recipe or Recipe(), "recompute": recompute})
    grad_inputs = [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(fn, torch.nn.Module):
        grad_inputs += [(f"param {n}", p) for n, p in fn.named_parameters() if p.requires_grad]
    eager = _run(fn, args, kwargs, eager_semantics_backend(options, surroundings), seed, grad_inputs)
    compiled = _run(fn, args, kwargs, backend_mod.backend(recipe=options.recipe, recompute=recompute,
                                                          compiler=compiler), seed, grad_inputs)
    torch._dynamo.reset()
    rows = []
    names = [f"output {i}" for i in range(len(eager[0]))] + [f"grad {n}" for n, _ in grad_inputs]
    for name, a, b in zip(names, eager[0] + eager[1], compiled[0] + compiled[1]):
        if a is None or b is None:
            rows.append(CompareRow(name, a is None and b is None, 0, 0.0))
            continue
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
        max_abs = float((a.double() - b.double()).abs().max()) if a.numel() and a.shape == b.shape else 0.0
        rows.append(CompareRow(name, same, ulp_distance(a, b) if a.shape == b.shape else -1, max_abs))
    return CompareReport(rows, surroundings)
