"""Look inside and check: ``explain``, ``dump_code``, ``compare``.

Each is called as torch._dynamo.explain is: ``tool(fn, backend=..., <tool options>)``
returns a callable, and ``(*args, **kwargs)`` on it are all the model's, so a model
argument named like a tool option (``seed``, ``scope``, ``backend``) reaches the model.
``backend`` is "nvfp4" or what ``nvfp4_inductor.backend(...)`` returns.

Each compiles `fn` afresh and leaves what the caller compiled alone (``compile_apart``):
its first frame runs a copy of `fn`'s code object, and where torch has them (2.13+) its
entries live in a recompile region of their own, so no cached entry of an earlier compile
answers for it and nothing is thrown away (no ``torch._dynamo.reset()``): a model
compiled before runs afterwards without recompiling. Two things Dynamo keeps per
function, not per compile, are shared: a frame an earlier compile gave up on ("skipping
the function") is skipped here too, so its graph breaks are not listed again, and sizes
seen with other values before may be traced as dynamic. The reports print as tables,
summary first; ``report.text(full=True)`` lists every site and every parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import pathlib
import re
import shutil
import types
import warnings
from typing import Any, Callable, Optional

import torch

from .compiler import backend as backend_mod
from .compiler.fused import explain_steps, saved_for_backward
from .compiler.options import BackendOptions
from .program import SiteOptions
from .target_ops import inlines, launches_traced


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in [headers] + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def backend_options(backend) -> BackendOptions:
    """The options a tool compiles with, from its `backend` argument: "nvfp4" (the backend's
    registered name: its default options) or what ``nvfp4_inductor.backend(...)`` returns."""
    if isinstance(backend, str) and backend == backend_mod.BACKEND_NAME:
        return BackendOptions()
    options = getattr(backend, "options", None)
    if not isinstance(options, BackendOptions):
        raise ValueError(f'backend must be "{backend_mod.BACKEND_NAME}" or what nvfp4_inductor.backend(...) '
                         f"returns; got {backend!r}")
    return options


def _ranges(indices: list[int]) -> str:
    """Site numbers as runs: [0, 1, 2, 3, 5] -> "0-3, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _grouped(items: list, key: Callable) -> list[tuple[list[int], Any]]:
    """(indices, first item) for each distinct `key(item)`, in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return [(indices, items[indices[0]]) for indices in groups.values()]


# ---------------------------------------------------------------------------------------
# compiling without touching the caller's compiled code

_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def compile_apart(fn: Callable, backend) -> Callable:
    """``torch.compile(fn, backend=backend)`` that neither finds nor disturbs what the
    caller compiled.

    Dynamo keeps compiled code on the code object a frame runs, guarded by the backend
    (an entry compiled for another backend never answers). Here the first frame runs a
    copy of `fn`'s code (``_fresh_code``), so nothing is cached on the caller's; code
    after a graph break is entered as its own frame, on the caller's code objects, where
    torch 2.13's ``isolate_recompiles`` keeps these entries in a region of their own (on
    older torch they count towards that code's recompile limit, 8 by default)."""
    return torch.compile(_fresh_code(fn), backend=backend, **({"isolate_recompiles": True} if _ISOLATE else {}))


def _copy_function(f: types.FunctionType) -> types.FunctionType:
    copy_ = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    copy_.__kwdefaults__, copy_.__dict__ = f.__kwdefaults__, dict(f.__dict__)
    return copy_


def _fresh_code(fn: Callable) -> Callable:
    """`fn` running a copy of its code object, so its first frame is compiled apart. A
    module becomes a shallow copy (the same parameters, buffers, submodules and hooks)
    whose forward is a copy; a module or function compiled with torch.compile is
    unwrapped first. Graphs, their names and source locations are those of `fn`."""
    fn = getattr(fn, "_orig_mod", fn)  # torch.compile(module)
    fn = torch._dynamo.eval_frame.innermost_fn(fn)  # torch.compile(function)
    if isinstance(fn, torch.nn.Module) and isinstance(fn.forward, types.MethodType) and fn.forward.__self__ is fn:
        # copy.copy without the class's __new__: FSDP2's module classes override it to build
        # the original class, which calls __init__ without its arguments
        clone = object.__new__(type(fn))
        clone.__dict__.update(fn.__dict__)
        clone.forward = types.MethodType(_copy_function(fn.forward.__func__), clone)
        return clone
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        return types.MethodType(_copy_function(fn.__func__), fn.__self__)
    if isinstance(fn, types.FunctionType):
        return _copy_function(fn)

    def nvfp4_inspect(*args, **kwargs):  # any other callable: a new function calling it
        return fn(*args, **kwargs)

    return _copy_function(nvfp4_inspect)


class _PerGraph:
    """What a backend learned about each graph it compiled, the last attempt per frame
    compile: Dynamo may restart a frame's analysis after calling the backend (e.g. to
    specialise a float it had made symbolic), and only the last attempt's graph runs."""

    def __init__(self):
        self._by_compile = {}

    def add(self, value) -> None:
        self._by_compile[str(torch._guards.CompileContext.current_compile_id())] = value

    def __iter__(self):
        return iter(self._by_compile.values())

    def __len__(self) -> int:
        return len(self._by_compile)


# ---------------------------------------------------------------------------------------
# graph breaks


@dataclasses.dataclass
class GraphBreak:
    """Where Dynamo broke the graph, grouped by place and kind."""

    location: str  # file:line of the user code that broke
    times: int  # how often Dynamo broke there while tracing (each retry of each frame counts)
    what: str  # Dynamo's kind of break (and the op, where it names one)
    fix: str  # what removes it, where known ("" where not)


_AT_LINE = re.compile(r"in user code at (.+?):(\d+)\s*$", re.M)
_FRAME = re.compile(r'File "(.+?)", line (\d+)')


class _BreakRecorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.breaks: list[tuple[str, int, str]] = []  # (file, line, reason)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        at = _AT_LINE.search(message)
        if at:  # symbolic_convert: "Graph break ... in user code at FILE:LINE\nGraph Break Reason: ..."
            reason = message.split("Graph Break Reason: ", 1)[-1].split("\nUser code traceback:", 1)[0]
            self.breaks.append((at[1], int(at[2]), reason))
            return
        frames = _FRAME.findall(message)  # convert_frame: the frame is skipped; the stack, then the error
        error = record.exc_info[1] if record.exc_info else None
        reason = getattr(error, "msg", None) or str(error or message.splitlines()[0])
        file, line = frames[-1] if frames else ("<unknown>", 0)
        self.breaks.append((file, int(line), reason))


@contextlib.contextmanager
def _recording_graph_breaks():
    """Record every graph break Dynamo logs while the block runs (its ``graph_breaks``
    log, switched on here and restored after; nothing is printed unless the caller had
    that log on already)."""
    from torch._dynamo import convert_frame, symbolic_convert

    recorder = _BreakRecorder()
    loggers = [log for log in (getattr(m, "graph_break_log", None) for m in (symbolic_convert, convert_frame)) if log]
    saved = [(log, log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.addHandler(recorder)
        if not log.isEnabledFor(logging.DEBUG):
            log.setLevel(logging.DEBUG)
            log.propagate = False
    try:
        yield recorder
    finally:
        for log, level, propagate in saved:
            log.removeHandler(recorder)
            log.setLevel(level)
            log.propagate = propagate


def _kind(reason: str) -> tuple[str, str]:
    """(what, Dynamo's hint) from a graph-break reason: the break's kind after Dynamo's
    framing lines, with its op where Dynamo names a short one."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    while len(lines) > 1 and lines[0].endswith(":") and "graph break" in lines[0].lower():
        lines.pop(0)  # "Encountered graph break when attempting to trace CALL: ...:", "... Graph break encountered:"
    if not lines:
        return "unknown", ""

    def field(name):
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(name + ":")), "")

    context = field("Developer debug context")
    what = f"{lines[0]} ({context})" if context and len(context) <= 40 else lines[0]
    return what, field("Hint")


def _modules(fn) -> list[torch.nn.Module]:
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return list(owner.modules()) if isinstance(owner, torch.nn.Module) else []


def _code_holds(code: types.CodeType, file: str, line: int) -> bool:
    lines = [n for *_, n in code.co_lines() if n is not None]
    return code.co_filename == file and bool(lines) and min(lines) <= line <= max(lines)


def _fix(modules: list[torch.nn.Module], file: str, line: int, what: str) -> str:
    """Our advice for a break, where we know one."""
    for module in modules:
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
        forward = getattr(type(module).forward, "__wrapped__", None)  # transformers' use_experts_implementation
        if implementation not in (None, "grouped_mm") and forward is not None and _code_holds(
                forward.__code__, file, line):
            return (f'model.set_experts_implementation("grouped_mm") (transformers experts; now "{implementation}", '
                    'a per-expert loop)')
    if "Unsafe side effect" in what:
        return ("a checkpointed region (torch.utils.checkpoint) that changes Python state outside it (transformers' "
                "hub-kernel decorators set a context variable in each layer's forward) stays out of the graph, "
                "and its grouped MLP with it. Where the recompute need not replay the change (that variable's "
                "set and reset do not), torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True "
                "lets Dynamo trace the region")
    if "bincount" in what:
        return ("count the rows per expert with torch.histc(ids.float(), bins=G, min=0, max=G - 1): "
                "no data-dependent size")
    return ""


def _group_breaks(fn, breaks: list[tuple[str, int, str]]) -> list[GraphBreak]:
    modules = _modules(fn)
    grouped: dict[tuple[str, int, str], list] = {}
    for file, line, reason in breaks:
        what, hint = _kind(reason)
        entry = grouped.setdefault((file, line, what), [0, hint])
        entry[0] += 1
    out = []
    for (file, line, what), (times, hint) in grouped.items():
        fix = _fix(modules, file, line, what) or (f"Dynamo: {hint}" if hint else "")
        out.append(GraphBreak(f"{pathlib.Path(file).name}:{line}", times, what, fix))
    return out


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
    traced: bool = False  # its target's launches are traced into Inductor's code (Target.inline)
    regions: tuple[str, ...] = ()  # the higher-order ops whose body holds it (rewrite.BODY_HOPS), outermost first
    policy: str = "default"  # the precision policy's rule that chose its recipe (compiler/precision.py)

    @property
    def checkpointed(self) -> bool:
        """Inside activation checkpointing: its forward is recomputed in the backward, so what
        it saves lives from that recompute to its backward, not across the step."""
        return "tag_activation_checkpoint" in self.regions

    @property
    def saved_bytes(self) -> int:
        return sum(b for *_, b in self.saved)

    def row(self) -> tuple:
        """Its row of explain's site table (without its number)."""
        return (self.location, self.spelling, self.activation, self.target,
                "recomputed (checkpointed)" if self.checkpointed else _bytes(self.saved_bytes))

    def plan(self) -> tuple:
        """Everything explain prints about it below the table: sites with the same plan print once."""
        return (self.reason, self.policy, self.traced, self.target, self.specialisation, self.regions,
                tuple(self.forward_steps), tuple(self.backward_steps), tuple(self.saved), self.estimated)

    def details(self) -> list[str]:
        out = ["launches: traced, Inductor's generated code launches each kernel" if self.traced else
               f"launches: one call per fused op ({self.target}'s steps are not traced here)"]
        if self.specialisation:
            out.append(f"routing: {self.specialisation}")
        out.extend(REGION_NOTES[hop] for hop in self.regions)
        if self.policy != "default":
            out.append(f"precision policy: NVFP4 with the recipe of {self.policy}")
        out.append(format_table(["forward step", "runs"], [list(step) for step in self.forward_steps]))
        out.append(format_table(["backward step", "runs"], [list(step) for step in self.backward_steps]))
        out.append(format_table(["saved tensor", "dtype", "shape", "bytes"],
                                [[n, d, "x".join(map(str, sh)), _bytes(b)] for n, d, sh, b in self.saved]))
        if self.estimated:
            out.append("(estimated: data-dependent sizes taken as their size hints, an unbacked "
                       "row count as torch._inductor.config.unbacked_symint_fallback)")
        return out


NO_CANDIDATE = ("no grouped-MLP candidate was seen in the {graphs} graph(s) Dynamo captured: no grouped GEMM -> "
                "activation -> grouped GEMM chain in any spelling the backend knows, nor a near miss it would name")


@dataclasses.dataclass
class ExplainReport:
    sites: list[SiteReport]
    rejected: list[tuple[str, str, str]]  # (location, spelling, reason)
    graph_breaks: list[GraphBreak]
    graphs: int
    kept: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (location, path, rule): kept in BF16

    def __str__(self) -> str:
        return self.text()

    def text(self, full: bool = False) -> str:
        """The summary line, the sites (identical rows and identical plans collapsed: "sites
        0-3"), the rejections and graph breaks, then each distinct plan's steps and saved
        tensors. `full`: every site on its own row and with its own plan."""
        breaks = sum(b.times for b in self.graph_breaks)
        out = [f"nvfp4 explain: {self.graphs} graph(s), {len(self.sites)} grouped MLP(s) rewritten, "
               + (f"{len(self.kept)} kept in BF16, " if self.kept else "")
               + f"{len(self.rejected)} rejected, {breaks} graph break(s)"
               + (f" at {len(self.graph_breaks)} place(s)" if self.graph_breaks else "")]
        if not self.sites and not self.rejected and not self.kept:
            out.append(NO_CANDIDATE.format(graphs=self.graphs)
                       + ("; the graph breaks below may have split one apart" if self.graph_breaks else ""))
        row, plan = (id, id) if full else (SiteReport.row, SiteReport.plan)
        plans = _grouped(self.sites, plan)
        if self.sites:
            out.append(format_table(["#", "site", "spelling", "activation", "target", "saved for bwd"],
                                    [[_ranges(indices), *site.row()] for indices, site in _grouped(self.sites, row)]))
        if self.kept:
            out.append("\nkept in BF16 by the precision policy (compiled as stock Inductor would):")
            out.append(format_table(["site", "module", "rule"], [list(k) for k in self.kept]))
        if self.rejected:
            out.append("\nnot rewritten (run as stock Inductor would):")
            out.append(format_table(["site", "spelling", "reason"], [list(r) for r in self.rejected]))
        if self.graph_breaks:
            out.append("\ngraph breaks: Dynamo split the code, and what runs between the graphs is not compiled. "
                       "An expert loop broken this way runs its experts outside any graph, so they cannot be "
                       "rewritten. Each place, with how often Dynamo broke there while tracing:")
            out.append(format_table(["where", "times", "what", "fix"],
                                    [[b.location, b.times, b.what, b.fix or "-"] for b in self.graph_breaks]))
        elif self.graphs > 1:
            out.append(f"\n{self.graphs} graphs, but Dynamo logged no graph break: a recompile, or a torch whose "
                       "Dynamo words its graph-break log differently (TORCH_LOGS=graph_breaks prints it)")
        for indices, site in plans:
            which = f"site {indices[0]}" if len(indices) == 1 else f"sites {_ranges(indices)} (same plan)"
            out.append(f"\n{which}: {site.reason}")
            out.extend(site.details())
        if len(plans) < len(self.sites):
            out.append("\n(sites with the same plan printed once; report.text(full=True) prints each)")
        return "\n".join(out)


REGION_NOTES = {
    "tag_activation_checkpoint": (
        "activation checkpointing: the site is in a checkpointed region (torch.utils.checkpoint), so its "
        "forward runs again in the backward, with the same bits (the forward rounds to nearest), and the "
        "tensors below are kept only from that recompute to its backward, not across the step"),
    "invoke_subgraph": (
        "nested compile region (torch.compiler.nested_compile_region): the site is in the region's body, "
        "compiled once, and every call of the region runs it"),
}


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
    symbol (no guard is taken: guarding on an unbacked size raises)."""
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


def _site_report(site, plan, call_node, options: BackendOptions, regions: tuple[str, ...] = (),
                 policy: str = "default") -> SiteReport:
    from .compiler.nodes import val

    x, w1, w2, sizes, probs = (None if a is None else val(a) for a in call_node.args[:5])
    recompute = plan.recomputes_d(options.recompute)
    kept = saved_for_backward(x, w1, w2, sizes, probs, activation=site.activation, recompute=recompute)
    saved = [
        (name, str(t.dtype).replace("torch.", ""), _concrete(t.shape), math.prod(_concrete(t.shape)) * t.element_size())
        for name, t in kept
    ]
    fwd, bwd = explain_steps(SiteOptions(site.activation, site.tanh_clamp_scale, options.recipe, plan, recompute,
                                         options.reuse_weight_casts))
    estimated = any(_size_hint(d)[1] for _, t in kept for d in t.shape)
    with launches_traced(options.trace_launches):  # as the backend compiles the site
        traced = inlines(plan.target, x.device)
    return SiteReport(site.location, site.spelling, site.activation, plan.target, plan.reason, fwd, bwd, saved,
                      _specialisation(site), estimated, traced, regions, policy)


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


def explain(fn: Callable, *, backend="nvfp4") -> Callable[..., ExplainReport]:
    """``nvfp4_inductor.explain(model, backend=...)(*args, **kwargs)``: compile `fn` with the
    nvfp4 backend's rewrite (``compile_apart``: the caller's compiled code stays), run it
    on `args` / `kwargs` (all of them the model's), and report every grouped MLP found
    (where, which spelling, target and why, the steps forward and backward, what is saved
    for backward), every near-miss with the reason it was not rewritten, and the graph
    breaks, grouped by place, with a fix where one is known. `backend`: "nvfp4" or what
    ``nvfp4_inductor.backend(...)`` returns, whose options the rewrite takes (its
    ``compiler`` does not matter: nothing is compiled past the rewrite)."""
    options = backend_options(backend)

    def nvfp4_explain(*args, **kwargs) -> ExplainReport:
        graphs = _PerGraph()  # (site reports, rejections) of each graph

        def recording_backend(gm, example_inputs, **kw):
            record = backend_mod.rewrite_graph(gm, options)
            graphs.add(([_site_report(site, plan, node, backend_mod.options_for_site(site, options, decision), regions,
                                      decision.rule)
                         for (site, plan), node, regions, decision in zip(record.sites, record.call_nodes,
                                                                         record.regions, record.decisions)],
                        [(r.location, r.spelling, r.reason) for r in record.rejections],
                        [(site.location, decision.info.path, decision.rule) for site, decision in record.kept]))
            return gm.forward

        with _recording_graph_breaks() as recorder:
            compile_apart(fn, recording_backend)(*args, **kwargs)
        return ExplainReport([s for sites, _, _ in graphs for s in sites],
                             [r for _, rejected, _ in graphs for r in rejected], _group_breaks(fn, recorder.breaks),
                             len(graphs), [k for _, _, kept in graphs for k in kept])

    return nvfp4_explain


# ---------------------------------------------------------------------------------------
# dump_code

DUMP_MARK = ".nvfp4_dump_code"


def _dump_folder(path) -> pathlib.Path:
    """`path`, empty: a folder an earlier ``dump_code`` wrote (it holds DUMP_MARK) is
    emptied; any other folder with files in it is refused, and nothing is deleted."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"dump_code: path must be a folder; {str(path)!r} is a file")
    if path.exists() and any(path.iterdir()):
        if not (path / DUMP_MARK).is_file():
            raise ValueError(f"dump_code: folder {str(path)!r} holds files that dump_code did not write; "
                             "give a new or empty folder (nothing was deleted)")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / DUMP_MARK).write_text("written by nvfp4_inductor.dump_code, which empties this folder when it "
                                  "writes here again\n")
    return path


DUMP_INDEX = "INDEX.txt"
DUMP_REWRITTEN = "nvfp4_rewritten"
# Dynamo names each graph __compiled_fn_<n>_<uuid4 with underscores>, n counting across the process
_GRAPH_NAME = re.compile(r"__compiled_fn_(\d+)(?:_[0-9a-f]{8}(?:_[0-9a-f]{4}){3}_[0-9a-f]{12})?")
# a line that runs a grouped MLP: the rewrite's call, an nvfp4:: op, Inductor's note on the nodes it fused
_GROUPED_MLP_LINE = re.compile(r"(fused_grouped_mlp)\(|\bnvfp4\.(\w+)\.default\("
                               r"|Source Nodes: \[[^\]]*\b(fused_grouped_mlp)\b")
# what depyf's files hold, by the part of their name after the graph's
_DUMPED = (
    ("__compiled_fn_", "the graph Dynamo captured, as the backend receives it (before the nvfp4 rewrite)"),
    ("pre_insert_deferred_runtime_asserts", "the graph as Dynamo captured it, before its runtime asserts"),
    (DUMP_REWRITTEN, "the graph after the nvfp4 rewrite: each site one fused_grouped_mlp call"),
    ("BEFORE_PRE_GRAD", "the graph after the nvfp4 rewrite, as Inductor receives it"),
    ("Joint_graph", "AOTAutograd's joint forward and backward graph"),
    ("tensorify_python_scalars", "AOTAutograd's joint graph after its tensorify_python_scalars pass"),
    ("Forward_graph", "AOTAutograd's forward graph (after the partition)"),
    ("Backward_graph", "AOTAutograd's backward graph (after the partition)"),
    ("AFTER_POST_GRAD", "Inductor's graph after its post-grad passes (.0 forward, .1 backward)"),
    ("kernel_", "Inductor's generated code (kernel_0 the forward, kernel_1 the backward)"),
    ("__transformed_code_", "a frame's bytecode as Dynamo rewrote it, decompiled: it calls the compiled graphs"),
    ("full_code_for_", "a frame's rewritten code with its guards"),
)


def _stable_names(path: pathlib.Path) -> dict[str, str]:
    """Dynamo's graph names in the dump renumbered from 1 in the order Dynamo compiled them,
    without their uuid, in file names and file contents alike: the same program dumps to the
    same file names in any process. Returns {new name: Dynamo's}."""
    files = [p for p in path.rglob("*") if p.is_file() and p.name != DUMP_MARK]
    numbers = sorted({int(m[1]) for p in files for m in _GRAPH_NAME.finditer(p.name)})
    renamed = {n: f"__compiled_fn_{i}" for i, n in enumerate(numbers, 1)}

    def stable(text: str) -> str:
        return _GRAPH_NAME.sub(lambda m: renamed[int(m[1])] if int(m[1]) in renamed else m[0], text)

    for p in files:
        try:
            text = p.read_text()
        except UnicodeDecodeError:  # not text: its name only
            text = ""
        if stable(text) != text:
            p.write_text(stable(text))
    moving = [(p.rename(p.with_name(p.name + ".renaming")), stable(p.name)) for p in files if stable(p.name) != p.name]
    for p, name in moving:  # in two steps: a new name may be another file's old one
        p.rename(p.with_name(name))
    return {new: f"__compiled_fn_{n}" for n, new in renamed.items()}


def _describe_dumped(name: str) -> str:
    part = name.split(".", 1)[1] if name.startswith("__compiled_fn_") else name
    return next((what for prefix, what in _DUMPED if part.startswith(prefix)), "-")


def _write_index(path: pathlib.Path, dynamos: dict[str, str]) -> None:
    """INDEX.txt: what each file holds, and each line that runs a grouped MLP."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in (DUMP_MARK, DUMP_INDEX))
    found = []
    for p in files:
        for number, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            match = _GROUPED_MLP_LINE.search(line)
            if match:
                op = match[1] or (f"nvfp4::{match[2]}" if match[2] else "Inductor code from fused_grouped_mlp")
                found.append([f"{p.relative_to(path)}:{number}", op])
    renumbered = ", ".join(f"{new} is Dynamo's {old}" for new, old in dynamos.items() if new != old)
    out = ["Written by nvfp4_inductor.dump_code (through depyf), with the compile caches off, so the same "
           "program gives the same files.",
           "Dynamo's graphs are numbered from 1 in the order compiled, without Dynamo's uuid, in file names and "
           "code alike" + (f" ({renumbered} in this process's logs)." if renumbered else "."),
           "",
           format_table(["file", "holds"], [[str(p.relative_to(path)), _describe_dumped(p.name)] for p in files]),
           "",
           "where the grouped MLPs run (the rewrite's fused_grouped_mlp call, the nvfp4:: ops it becomes):"
           if found else "no line runs a grouped MLP: the nvfp4 backend rewrote none (explain says why)."]
    if found:
        out.append(format_table(["file:line", "runs"], found))
    (path / DUMP_INDEX).write_text("\n".join(out) + "\n")


def dump_code(fn: Callable, *, path, backend="nvfp4") -> Callable[..., list[pathlib.Path]]:
    """``nvfp4_inductor.dump_code(model, path="dump/", backend=...)(*args, **kwargs)``: compile
    and run `fn` on `args` / `kwargs` (all of them the model's) with `backend` ("nvfp4" or
    what ``nvfp4_inductor.backend(...)`` returns), forward and backward when an output needs
    grad, under depyf, which writes the Dynamo graphs, the graph after the nvfp4 rewrite,
    the AOTAutograd forward/backward graphs and Inductor's generated code to the folder
    `path`; returns the files written. INDEX.txt says what each file holds and names each
    line that runs a grouped MLP. Inductor's and AOTAutograd's caches are off while it
    compiles (``force_disable_caches``): a cache hit skips the steps whose graphs depyf
    writes, and the files would depend on what ran before. The caller's ``.grad`` are left
    as they were. A folder an earlier dump_code wrote is emptied first, so old and new
    files never mix; a folder holding anything else is refused. The fused ops' options
    read by name in the graphs and the code (``activation='swiglu', rht=True``)."""
    options = backend_options(backend)

    def nvfp4_dumped(gm, example_inputs, **kw):  # the nvfp4 backend, writing the graph it rewrote
        backend_mod.rewrite_graph(gm, options)
        torch._dynamo.utils.lazy_format_graph_code(DUMP_REWRITTEN, gm)  # depyf writes each graph torch formats
        return backend_mod.compile_rewritten(gm, example_inputs, options)

    def nvfp4_dump_code(*args, **kwargs) -> list[pathlib.Path]:
        import depyf

        folder = _dump_folder(path)
        compiled = compile_apart(fn, nvfp4_dumped)
        with (torch._inductor.config.patch(force_disable_caches=True), depyf.prepare_debug(str(folder)),
              _callers_grads_kept([t for _, t in _grad_inputs(fn, args, kwargs)])):
            outs = [o for o in _flatten(compiled(*args, **kwargs)) if o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [_fixed_grad(o, i) for i, o in enumerate(outs)])
        _write_index(folder, _stable_names(folder))
        return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DUMP_MARK)

    return nvfp4_dump_code


# ---------------------------------------------------------------------------------------
# compare

SCOPES = ("blocks", "program")


@dataclasses.dataclass
class CompareRow:
    """One output or gradient, eager side (a) against compiled side (b)."""

    name: str
    bitwise: bool
    differ: int  # elements whose bits differ
    numel: int
    max_abs: float  # max |b - a|
    rel: float  # ||b - a|| / ||a|| (Frobenius)
    max_ulps: Optional[float]  # max of ulps(a, b); None for integer tensors
    note: str = ""  # why the tensors could not be compared element by element


@dataclasses.dataclass
class CompareReport:
    rows: list[CompareRow]
    scope: str
    compiler: str
    sites: int  # grouped MLPs the nvfp4 backend rewrote
    rejected: int
    graphs: int

    @property
    def bitwise(self) -> Optional[bool]:
        """True / False; None when nothing was rewritten (no verdict about nvfp4)."""
        return all(r.bitwise for r in self.rows) if self.sites else None

    @property
    def verdict(self) -> str:
        return {True: "BITWISE EQUAL", False: "DIFFERENT", None: "NO VERDICT"}[self.bitwise]

    def __str__(self) -> str:
        return self.text()

    def text(self, full: bool = False) -> str:
        """The verdict, then a table of the outputs and gradients: the parameters' gradients
        that are bitwise equal in one row (those that differ listed each); `full`: every
        parameter on its own row."""
        if not self.sites:
            why = (f"{self.rejected} grouped-MLP candidate(s) rejected (nvfp4_inductor.explain(fn)(*args) gives "
                   "each reason)" if self.rejected else NO_CANDIDATE.format(graphs=self.graphs))
            return (f"nvfp4 compare: NO VERDICT: the nvfp4 backend rewrote no grouped MLP, so no nvfp4 op ran and "
                    f"there is nothing of ours to compare; {why}")
        blocks = f"{self.sites} grouped MLP block(s)"
        if self.scope == "blocks":
            header = (f"nvfp4 compare, scope='blocks': {blocks} as the eager NVFP4 chain (nvfp4_inductor.grouped_mlp, "
                      f"op by op) vs as the fused nvfp4 ops; every other op compiled by {self.compiler} on both "
                      f"sides: {self.verdict}")
        else:
            header = (f"nvfp4 compare, scope='program': eager PyTorch (the eager NVFP4 chain in {blocks}) vs "
                      f"torch.compile(backend=nvfp4, compiler={self.compiler!r}): {self.verdict}")
        rows = self.rows if full else self._summarised_rows()
        notes = any(r.note for r in rows)
        table = format_table(
            ["tensor", "bitwise", "differ", "max |diff|", "rel diff", "max ulps"] + (["note"] if notes else []),
            [[r.name, "yes" if r.bitwise else "NO", f"{r.differ}/{r.numel}", f"{r.max_abs:.3g}", f"{r.rel:.3g}",
              "-" if r.max_ulps is None else f"{r.max_ulps:.4g}"] + ([r.note] if notes else [])
             for r in rows])
        out = [header, table]
        if len(rows) < len(self.rows):
            out.append("(the equal parameter gradients in one row; report.text(full=True) lists each)")
        if not self.bitwise:
            out.append("differ: elements whose bits differ; rel diff: ||compiled - eager|| / ||eager||; ulps: "
                       "|compiled - eager| in steps of the dtype at the larger magnitude of the two")
            if self.scope == "program":
                out.append(f"Outside the blocks, {self.compiler} may round fused bf16 chains differently from eager "
                           "(its own behaviour, not nvfp4's); scope='blocks' (the default) compares the blocks alone.")
        return "\n".join(out)

    def _summarised_rows(self) -> list[CompareRow]:
        """Each row, but the parameters' gradients that are bitwise equal (and compared
        element by element) as one row after the others, where there are two or more."""
        equal = [r for r in self.rows if r.name.startswith("grad param ") and r.bitwise and not r.note]
        if len(equal) < 2:
            return self.rows
        ulps_ = [r.max_ulps for r in equal if r.max_ulps is not None]
        merged = CompareRow(f"grad param: {len(equal)} parameters", True, 0, sum(r.numel for r in equal), 0.0, 0.0,
                            max(ulps_) if ulps_ else None)
        return [r for r in self.rows if not any(r is e for e in equal)] + [merged]


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


def _element_bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of the same width (so -0.0 != 0.0 and NaNs compare by payload)."""
    if not t.is_floating_point():
        return t
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, |a - b| in units of the dtype's spacing at max(|a|, |b|) (its ulp
    there; below the smallest normal number, the subnormal spacing). Equal bits give 0,
    differing non-finite values inf. Well defined across zero: bf16 0.002 against -0.0024
    is 0.0044 / 2**-16 = 288 ulps, where counting the representable values between them
    gives ~30,000."""
    finfo = torch.finfo(a.dtype)
    a64, b64 = a.double(), b.double()
    exponent = torch.frexp(torch.maximum(a64.abs(), b64.abs())).exponent - 1  # m = 1.f * 2**exponent
    spacing = finfo.eps * torch.pow(2.0, exponent.clamp(min=round(math.log2(finfo.tiny))).double())
    out = (a64 - b64).abs() / spacing
    out = torch.where(torch.isfinite(a64) & torch.isfinite(b64), out, torch.inf)
    return torch.where(_element_bits(a) == _element_bits(b), 0.0, out)


def _compare_tensors(name: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> CompareRow:
    if a is None or b is None:
        same = a is None and b is None
        return CompareRow(name, same, 0 if same else 1, 0, 0.0, 0.0, None,
                          "no gradient on either side" if same else
                          f"no gradient on the {'eager' if a is None else 'compiled'} side")
    a, b = _local(a), _local(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return CompareRow(name, False, a.numel(), a.numel(), math.nan, math.nan, None,
                          f"eager {a.dtype} {tuple(a.shape)} vs compiled {b.dtype} {tuple(b.shape)}")
    differ = int((_element_bits(a) != _element_bits(b)).sum())
    if a.numel() == 0:
        return CompareRow(name, True, 0, 0, 0.0, 0.0, 0.0 if a.is_floating_point() else None)
    a64, b64 = a.double(), b.double()
    diff = (b64 - a64).norm()
    norm = a64.norm()
    rel = float(diff / norm) if norm > 0 else (0.0 if diff == 0 else math.inf)
    return CompareRow(name, differ == 0, differ, a.numel(), float((b64 - a64).abs().max()), rel,
                      float(ulps(a, b).max()) if a.is_floating_point() else None)


def _run(fn, args, kwargs, backend, seed, grad_inputs):
    torch.manual_seed(seed)
    outs = _flatten(compile_apart(fn, backend)(*args, **kwargs))
    diff = [o for o in outs if o.requires_grad]
    grads = _backward_grads(diff, [t for _, t in grad_inputs]) if diff and grad_inputs else []
    return [o.detach() for o in outs], grads


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what this rank computed; every rank compares its own),
    any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _register_sharded_parameters(module: torch.nn.Module) -> None:
    """Registers each FSDP2 module's sharded parameters, the ones its backward leaves the
    gradients on. After a forward that no backward followed (``explain``'s, a no_grad
    evaluation) FSDP2 keeps the root's all-gathered copies registered until its next
    backward ends, and reading ``.grad`` off those would find none."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _grad_inputs(fn: Callable, args, kwargs) -> list[tuple[str, torch.Tensor]]:
    """What a backward of `fn` leaves gradients on: the arguments (positional and keyword)
    that require grad and, when `fn` is a module, its parameters (FSDP2's sharded ones)."""
    given = [(f"arg{i}", a) for i, a in enumerate(args)] + [(f"arg {k}", a) for k, a in kwargs.items()]
    out = [(name, a) for name, a in given if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(fn, torch.nn.Module):
        _register_sharded_parameters(fn)
        out += [(f"param {n}", p) for n, p in fn.named_parameters() if p.requires_grad]
    return out


@contextlib.contextmanager
def _callers_grads_kept(tensors: list[torch.Tensor]):
    """Inside, each tensor's ``.grad`` starts at None (retained for non-leaves); after, the
    caller's own ``.grad`` is put back, so an inspection's backward changes no gradient."""
    kept = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
        if not t.is_leaf:
            t.retain_grad()
    try:
        yield
    finally:
        for t, grad in zip(tensors, kept):
            t.grad = grad


def _backward_grads(outs: list[torch.Tensor], wrt: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """The gradients of `wrt` from one backward of `outs` (fixed output gradients), read from
    ``.grad`` as a training step leaves them: an FSDP2 parameter gets its gradient only there
    (reduce-scattered by FSDP's hooks; ``autograd.grad`` would see the unsharded copy FSDP
    computes with, not the parameter)."""
    with _callers_grads_kept(wrt):
        torch.autograd.backward(outs, [_fixed_grad(o, i) for i, o in enumerate(outs)])
        return [t.grad for t in wrt]


def _eager_chain_call(site_options: BackendOptions, plan):
    """A site's callable running the eager NVFP4 chain, op by op (it chooses the same
    target as `plan` itself), and its constant keyword arguments (none)."""
    from .nn import grouped_mlp

    def nvfp4_eager_grouped_mlp(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation, tanh_clamp_scale):
        return grouped_mlp(x, fc1_weight, fc2_weight, group_sizes, probs, activation=activation,
                           tanh_clamp_scale=tanh_clamp_scale, recipe=site_options.recipe)

    return nvfp4_eager_grouped_mlp, {}


def eager_semantics_backend(options: BackendOptions, scope: str = "blocks"):
    """Each recognised site replaced by the eager NVFP4 chain (``nvfp4_inductor.grouped_mlp``,
    op by op): the semantics the compiled runs must match. scope "blocks": every other op
    compiled by ``options.compiler`` as the nvfp4 backend compiles it, so the blocks alone
    differ from the backend's program; "program": every other op runs eagerly."""

    def nvfp4_eager_chain(gm, example_inputs, **kw):
        backend_mod.rewrite_graph(gm, options, site_call=_eager_chain_call)
        if scope == "program":
            return gm.forward
        return backend_mod.compile_rewritten(gm, example_inputs, options)

    return nvfp4_eager_chain


@contextlib.contextmanager
def _deterministic_algorithms(enabled: bool):
    """Inside, ``torch.use_deterministic_algorithms(True, warn_only=True)`` when `enabled`,
    the caller's mode after. On CUDA, ops that add with atomics (``scatter_add``,
    ``index_add``, a gather's or an indexing's backward) add in an order that changes from
    run to run: the same compiled program twice differs in some bits. warn_only: an op with
    no deterministic kernel (CUDA's ``histc``, a router's counts) still runs, and cuBLAS runs
    without ``CUBLAS_WORKSPACE_CONFIG`` set; their warnings are silenced here."""
    if not enabled:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation")
            warnings.filterwarnings("ignore", message="Deterministic behavior was enabled")
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def compare(fn: Callable, *, backend="nvfp4", scope: str = "blocks", seed: int = 0,
            deterministic: bool = True) -> Callable[..., CompareReport]:
    """``nvfp4_inductor.compare(model, backend=...)(*args, **kwargs)``: are the rewritten
    blocks exactly the eager NVFP4 chain? Runs `fn` on `args` / `kwargs` (all of them the
    model's) twice, forward and backward (fixed output gradients, same seed), and compares
    every output and every gradient (inputs that require grad, and parameters when `fn` is
    a module) bit for bit, with how many elements differ, max |diff|, the relative
    difference and ulps beside.

    backend: "nvfp4" or what ``nvfp4_inductor.backend(...)`` returns; its options (recipe,
        recompute, compiler, ...) compile both sides. When it rewrites no grouped MLP, the
        report gives no verdict (``bitwise`` is None).
    scope "blocks" (default): both sides run the same compiled program, every op outside
        the grouped MLPs compiled by the backend's ``compiler`` the same way; the blocks run
        as the eager NVFP4 chain on one side and as the nvfp4 backend's fused ops on the other.
    scope "program": eager PyTorch (with the eager chain in the blocks) against the whole
        program compiled by the nvfp4 backend; differences outside the blocks are then
        the compiler's own rounding.
    seed: ``torch.manual_seed`` before each side's run.
    deterministic (default True): both sides run under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``, the caller's mode restored
    after: on CUDA the atomics of a ``scatter_add`` combine or a gather's backward would
    otherwise make two runs of one program differ."""
    options = backend_options(backend)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}; got {scope!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int; got {seed!r}")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool; got {deterministic!r}")

    def nvfp4_compare(*args, **kwargs) -> CompareReport:
        grad_inputs = _grad_inputs(fn, args, kwargs)
        records = _PerGraph()

        def nvfp4(gm, example_inputs, **kw):  # the nvfp4 backend, keeping what it rewrote
            records.add(backend_mod.rewrite_graph(gm, options))
            return backend_mod.compile_rewritten(gm, example_inputs, options)

        with _deterministic_algorithms(deterministic):
            compiled = _run(fn, args, kwargs, nvfp4, seed, grad_inputs)
            sites, rejected = sum(len(r.sites) for r in records), sum(len(r.rejections) for r in records)
            if not sites:
                return CompareReport([], scope, options.compiler, 0, rejected, len(records))
            eager = _run(fn, args, kwargs, eager_semantics_backend(options, scope), seed, grad_inputs)
        names = [f"output {i}" for i in range(len(eager[0]))] + [f"grad {n}" for n, _ in grad_inputs]
        rows = [_compare_tensors(name, a, b)
                for name, a, b in zip(names, eager[0] + eager[1], compiled[0] + compiled[1])]
        return CompareReport(rows, scope, options.compiler, sites, rejected, len(records))

    return nvfp4_compare
