"""The ``nvfp4`` torch.compile backend: rewrite grouped-MLP sites, then Inductor as usual.

    Dynamo graph
      -> find_sites            every grouped-MLP spelling, plus rejections with reasons
      -> choose_plan           target + fused-kernel decisions per site (lowerings/policy.py)
      -> rewrite_sites         each site becomes one ``fused_grouped_mlp`` call running its plan
      -> compile_fx            Inductor compiles the whole graph; AOTAutograd saves what
                               the fused op's autograd formula saves

Registered under the name "nvfp4" both through the ``torch_dynamo_backends`` entry point
and at import, guarded so either order works (a name registered twice raises).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import warnings
from typing import Optional

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import kernels
from ..lowerings import Plan, SiteSpec, choose_plan, get_target
from ..recipe import Recipe
from ..target_ops import launches_traced
from . import early_compile
from .fused import fused_grouped_mlp, site_options
from .launch_analysis import launches_analysed_once
from .legality import weight_shape
from .match_grouped_mlp import recipe_call
from .options import BackendOptions
from .precision import Precision, SiteDecision, bf16_grouped_mlp, site_infos
from .recompute_order import hoist_site_recompute
from .rewrite import find_sites, graph_modules, rewrite_sites, unreached_sites
from .site import Rejection, Site

BACKEND_NAME = "nvfp4"

# Under the package's logger "nvfp4_inductor", which TORCH_LOGS takes by name as for any
# module: TORCH_LOGS="nvfp4_inductor" prints each site's decision and the compile progress,
# "+nvfp4_inductor" adds the options, each plan's reason and the rewritten graph. Without it
# nothing is printed (a rejected grouped MLP still warns: ``warn_rejections``).
log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompiledGraphRecord:
    """What one backend call did, for ``explain``: each site with its plan, the call node
    that replaced it and the higher-order ops whose body it is in (``rewrite.BODY_HOPS``,
    outermost first; () in the graph itself), and each rejection; each site the precision
    policy kept in BF16 with its decision, and the decision of each rewritten site."""

    sites: list[tuple[Site, Plan]]
    call_nodes: list[torch.fx.Node]
    rejections: list[Rejection]
    options: BackendOptions
    regions: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    kept: list[tuple[Site, SiteDecision]] = dataclasses.field(default_factory=list)
    decisions: list[SiteDecision] = dataclasses.field(default_factory=list)


class _ChainedPass(CustomGraphPass):
    """A graph pass of ours, then ``then``: the pass the user's Inductor config had in the
    same slot (one or several; newer torch takes a list). Its uuid holds this package's
    sources' hash, so Inductor's and AOTAutograd's caches miss when our code changes (else
    they serve artifacts built by older code)."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(graph)
        for then in self._then():
            then(graph)

    def run(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def _then(self) -> tuple:
        return () if self.then is None else tuple(self.then) if isinstance(self.then, (list, tuple)) else (self.then,)

    def uuid(self) -> Optional[bytes]:
        # None where a pass it runs has no uuid: Inductor's caches then bypass, as for that pass alone
        then = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self._then()]
        return None if None in then else _package_hash() + type(self).__name__.encode() + repr(then).encode()


class _HoistSiteRecompute(_ChainedPass):
    """The post-grad pass: each checkpointed site's recompute before its backward
    (``recompute_order.hoist_site_recompute``; a no-op on other graphs), then the user's."""

    def run(self, graph: torch.fx.Graph) -> None:
        hoist_site_recompute(graph)


class _WaitForCompileWorkers(_ChainedPass):
    """The last post-grad pass of a graph that launches our kernels on a GPU: wait until
    Inductor's compile workers are up before Inductor generates the graph's code. Our
    kernels are the graph's largest (a second or more each to compile); asked for while the
    pool still starts, they compile in this process one after another (one S3 layer's
    forward on an H100: kernels finishing over ~6 s, one at a time, 2026-12-06), where the
    workers compile them side by side. Then wait for the early compiles of the graph's
    phase (``early_compile.wait``), so that Inductor finds their binaries in Triton's cache
    instead of compiling a kernel again beside its early compile. A post-grad pass runs
    only where Inductor compiles the graph, never for one its cache serves, so a warm start
    does not wait."""

    def run(self, graph: torch.fx.Graph) -> None:
        from torch._higher_order_ops.triton_kernel_wrap import (triton_kernel_wrapper_functional,
                                                                triton_kernel_wrapper_mutation)

        launches = any(node.target in (triton_kernel_wrapper_functional, triton_kernel_wrapper_mutation)
                       for node in graph.nodes)
        if launches and _on_gpu(node.meta.get("val") for node in graph.find_nodes(op="placeholder")):
            wait_for_compile_workers()
            early_compile.wait()


class _RecomputeEmptyPlaceholders(_ChainedPass):
    """A joint-graph pass (before the min-cut partition, under either compiler) that marks
    every empty tensor made from nothing -- the zero-size stand-ins our op bodies pass for a
    kernel's unused operands and outputs -- to be made again where the backward uses it.
    Saving a zero-size tensor costs the partitioner's min-cut nothing, so it kept the
    backward's stand-ins (made from saved tensors, not from the gradient) in the forward and
    saved them: a dozen more allocations, saved tensors and backward arguments a step, host
    time for nothing."""

    def run(self, graph: torch.fx.Graph) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        for node in graph.nodes:
            value = node.meta.get("val")
            if (node.op == "call_function" and not node.all_input_nodes and isinstance(value, torch.Tensor)
                    and statically_known_true(value.numel() == 0)
                    and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


@functools.cache
def _package_hash() -> bytes:
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    return get_hash_for_files(tuple(sorted(str(p) for p in root.rglob("*.py"))))


def _site_call(options: BackendOptions, plan: Plan) -> tuple:
    """What a rewritten site calls: ``fused_grouped_mlp``, a function of this package that
    AOTAutograd's cache may key on (``inductor_patches``), with the site's options and plan
    as its constant keyword arguments (``fused.site_options``)."""
    return fused_grouped_mlp, site_options(options.recipe, options.recompute, plan, options.reuse_weight_casts)


def options_for_site(site: Site, options: BackendOptions, decision: SiteDecision) -> BackendOptions:
    """The precision policy's recipe for the site where it gives one; else a
    ``grouped_mlp``/``GroupedMLP`` call keeps the recipe its caller gave it, and plain
    spellings take the backend's."""
    if decision.recipe is not None:
        return dataclasses.replace(options, recipe=decision.recipe)
    if site.spelling != "grouped_mlp_module":
        return options
    recipe_node = recipe_call(site.output)
    if recipe_node is not None:
        return dataclasses.replace(options, recipe=Recipe(*recipe_node.args, **recipe_node.kwargs))
    recipe = site.output.kwargs.get("recipe")
    return dataclasses.replace(options, recipe=recipe) if isinstance(recipe, Recipe) else options


def example_device(gm: torch.fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def plan_for(site: Site, device: torch.device, recipe: Recipe, cudnn: str = "auto") -> Plan:
    """The site's plan (lowerings/policy.py), chosen once; the fused ops run it. The call
    always takes bf16 operands (fp32 ones under bf16 autocast are cast before it)."""
    fc2 = weight_shape(site.fc2_weight)
    return choose_plan(SiteSpec.on(device, site.activation, dtype=torch.bfloat16, hidden=fc2[1], ffn=fc2[2]),
                       recipe, cudnn=cudnn)


def rewrite_graph(gm: torch.fx.GraphModule, options: BackendOptions, site_call=None) -> CompiledGraphRecord:
    """Find and rewrite every site in place, in the graph and in the bodies of checkpointed and
    nested compile regions (``rewrite.graph_modules``; a site in another higher-order op's body
    is a rejection, ``rewrite.unreached_sites``); returns what was done. `site_call(options, plan)`
    gives each site's (callable, its constant keyword arguments) (default: the fused NVFP4
    ops running the plan, ``_site_call``). Counts graphs, sites and
    rejections in ``torch._dynamo.utils.counters["nvfp4"]`` (and per spelling)."""
    device = example_device(gm)
    record = CompiledGraphRecord([], [], [], options)
    counters["nvfp4"]["graphs"] += 1
    modules = graph_modules(gm)  # the graph, then the bodies of checkpointed / nested regions
    found = [(module, inside, *find_sites(module)) for module, inside in modules]
    # the precision policy sees every site of the graph at once: it counts MoE layers
    decisions = iter(options.precision.decide(site_infos(
        [site for _, _, sites, _ in found for site in sites], options.precision.moe_layers)))
    for module, inside, sites, rejections in found:
        record.rejections.extend(rejections)
        rewritten, calls = [], []
        for site in sites:
            decision = next(decisions)
            if not decision.nvfp4:
                record.kept.append((site, decision))
                counters["nvfp4"]["sites_kept_bf16"] += 1
                if site.spelling == "grouped_mlp_module":  # NVFP4 by construction: its block in BF16
                    rewritten.append(site)
                    calls.append((bf16_grouped_mlp, {}))
                continue
            counters["nvfp4"]["sites_rewritten"] += 1
            counters["nvfp4_rewritten_by_spelling"][site.spelling] += 1
            site_backend_options = options_for_site(site, options, decision)
            plan = plan_for(site, device, site_backend_options.recipe, options.cudnn)
            rewritten.append(site)
            calls.append((site_call or _site_call)(site_backend_options, plan))
            _log_site(site, plan, inside, site_backend_options)
            record.sites.append((site, plan))
            record.regions.append(inside)
            record.decisions.append(decision)
        nodes = rewrite_sites(module, rewritten, make_call=[fn for fn, _ in calls],
                              call_options=[kwargs for _, kwargs in calls])
        record.call_nodes.extend(node for node, (fn, _) in zip(nodes, calls) if fn is not bf16_grouped_mlp)
    record.rejections.extend(unreached_sites(modules))  # sites in other higher-order ops' bodies: reported
    counters["nvfp4"]["sites_rejected"] += len(record.rejections)
    for rejection in record.rejections:
        counters["nvfp4_rejected_by_spelling"][rejection.spelling] += 1
    _log_decisions(gm, record)
    return record


def _plan_summary(plan: Plan, recompute: bool) -> str:
    fused = [name for name, on in (("fc1+activation", plan.fused_fc1), ("amax", plan.fused_amax),
                                   ("dgrad+activation backward", plan.fused_dgrad)) if on]
    return (f"target {plan.target}, {'fused ' + ', '.join(fused) if fused else 'no fused kernels'}, "
            f"D {'recomputed' if plan.recomputes_d(recompute) else 'saved'} for the backward")


def _log_site(site: Site, plan: Plan, inside: tuple[str, ...], options: BackendOptions) -> None:
    """A rewritten site's INFO line: where, what, the plan in short; at DEBUG the plan's
    reason and the site's recipe."""
    if log.isEnabledFor(logging.INFO):
        g, h, f = weight_shape(site.fc2_weight)
        log.info("nvfp4: rewrote %s at %s%s (%s, %d experts, H=%d, F=%d): %s", site.spelling, site.location,
                 f" in {' > '.join(inside)}" if inside else "", site.activation, g, h, f,
                 _plan_summary(plan, options.recompute))
        log.debug("nvfp4: plan for %s: %s; %s", site.location, plan.reason, options.recipe)


def _log_decisions(gm: torch.fx.GraphModule, record: CompiledGraphRecord) -> None:
    """After a graph's rewrite: each rejection (where, why) and the count at INFO; at DEBUG
    the options and the rewritten graph."""
    if not log.isEnabledFor(logging.INFO):
        return
    for site, decision in record.kept:
        log.info("nvfp4: kept %s at %s in BF16 (precision policy: %s)", site.spelling, site.location, decision.rule)
    for rejection in record.rejections:
        log.info("nvfp4: left %s at %s as written: %s", rejection.spelling, rejection.location, rejection.reason)
    found = len(record.sites) + len(record.kept) + len(record.rejections)
    if found:
        log.info("nvfp4: %d of %d grouped MLP(s) in this graph rewritten to NVFP4", len(record.sites), found)
    else:
        log.info("nvfp4: no grouped MLP in this graph (%d nodes)", len(gm.graph.nodes))
    log.debug("nvfp4: backend options %s", record.options)
    if record.sites and log.isEnabledFor(logging.DEBUG):
        log.debug("nvfp4: the rewritten graph:\n%s", gm.print_readable(print_output=False))


REJECTED = (
    "nvfp4 backend: {rewritten} of {found} grouped MLP(s) in a compiled graph rewritten to NVFP4; "
    "the other {left} run as written. {first_where}: {first_reason}. nvfp4_inductor.explain(model)"
    "(*inputs) lists every site and reason; TORCH_LOGS=\"nvfp4_inductor\" logs each decision."
)


def warn_rejections(record: CompiledGraphRecord) -> None:
    """One warning for a graph where a grouped MLP was found but left as written (wrong
    dtypes, sizes, an activation without an NVFP4 rule...): such a model trains as it was
    written, not in NVFP4, and should not do so silently. None for a graph without grouped
    MLPs. The inspection tools call ``rewrite_graph`` and report rejections themselves."""
    if record.rejections:
        first = record.rejections[0]
        warnings.warn(REJECTED.format(
            rewritten=len(record.sites), found=len(record.sites) + len(record.rejections),
            left=len(record.rejections), first_where=f"{first.spelling} at {first.location}",
            first_reason=first.reason), stacklevel=2)


REUSE_UNDER_CUDA_GRAPHS = (
    "nvfp4 backend: reuse_weight_casts=True does not run under CUDA graphs ({why}). A replay runs no "
    "Python, so it casts the weights at every step anyway, and Inductor's graph trees warm a graph up "
    "with their private memory pool in use: copies kept then would be allocations the trees do not "
    "track, in memory their replays reuse. Compile with one or the other."
)


def check_mode(mode: Optional[str], options: BackendOptions) -> None:
    """torch.compile hands a custom backend its ``mode`` unchecked (stock Inductor checks
    its own); here it is one of Inductor's modes, and only where Inductor compiles:
    ``compiler="aot_eager"`` would drop it silently (no CUDA graphs, no autotuning). Nor
    may CUDA graphs (a mode's or Inductor's own ``triton.cudagraphs``) meet the option
    ``reuse_weight_casts`` (``REUSE_UNDER_CUDA_GRAPHS`` says why)."""
    from torch._inductor import config, list_mode_options

    if mode is not None and mode not in list_mode_options():
        raise ValueError(f"unknown torch.compile mode {mode!r} for the nvfp4 backend; valid modes are "
                         f"{sorted(list_mode_options())}")
    if mode is not None and options.compiler != "inductor":
        raise ValueError(f"torch.compile mode {mode!r} configures Inductor; the nvfp4 backend's "
                         f"compiler={options.compiler!r} would ignore it")
    by_mode = list_mode_options(mode).get("triton.cudagraphs") if mode is not None else None
    if options.reuse_weight_casts and options.compiler == "inductor" and (by_mode or (
            by_mode is None and config.triton.cudagraphs)):
        why = f"mode={mode!r}" if by_mode else "torch._inductor.config.triton.cudagraphs is set"
        raise ValueError(REUSE_UNDER_CUDA_GRAPHS.format(why=why))


def compile_graph(gm, example_inputs, options: BackendOptions, *, mode: Optional[str] = None):
    check_mode(mode, options)
    if options.compiler == "inductor" and _on_gpu(example_inputs):
        start_compile_workers()
    warn_rejections(rewrite_graph(gm, options))
    return compile_rewritten(gm, example_inputs, options, mode=mode)


def compile_rewritten(gm, example_inputs, options: BackendOptions, *, mode: Optional[str] = None):
    """The rewritten graph through ``options.compiler``: Inductor, or AOTAutograd alone.
    ``mode`` (torch.compile's) becomes Inductor config patches as for ``backend="inductor"``:
    "reduce-overhead" sets ``triton.cudagraphs`` (CUDA graph trees; Inductor skips them for
    graphs on the CPU). compile_fx applies the patches to the backward's compile too."""
    # AOTAutograd traces the fused ops in here; Inductor lowers the backward later, at the
    # first backward call, in inner_compile: each analyses the traced launches
    sites = _site_count(gm)
    if sites:
        log.info("nvfp4: compiling %d grouped MLP(s) through AOTAutograd and %s", sites, options.compiler)
    start = time.perf_counter()
    with launches_traced(options.trace_launches), launches_analysed_once():
        if options.compiler == "aot_eager":
            compiled = _aot_eager(gm, example_inputs)
        else:
            from torch._inductor.compile_fx import compile_fx

            traced = traces_launches(gm, options)
            if traced and _on_gpu(example_inputs) and early_compile.workers_available():
                _start_early_compiles(gm)
            compiled = compile_fx(gm, example_inputs, inner_compile=_inner_compile,
                                  config_patches=inductor_patches(mode, options, traced=traced))
    if sites:
        log.info("nvfp4: AOTAutograd traced the graph%s in %.1f s",
                 " and Inductor compiled its forward (a backward compiles at its first call)"
                 if options.compiler == "inductor" else "", time.perf_counter() - start)
    return compiled


def _start_early_compiles(gm: torch.fx.GraphModule) -> None:
    """``early_compile.start``: an optimisation of the first step only, so a failure warns
    and leaves every kernel to Inductor, as without it."""
    try:
        early_compile.start(gm, example_device(gm), grad=torch.is_grad_enabled())
    except Exception as error:  # noqa: BLE001 -- Inductor still compiles every kernel when it asks
        warnings.warn(f"nvfp4 backend: our kernels' early compiles did not start ({type(error).__name__}: "
                      f"{error}); Inductor compiles them when it asks, and the first step takes longer", stacklevel=2)


def _site_count(gm: torch.fx.GraphModule) -> int:
    """The rewritten sites in a graph and its checkpointed / nested bodies (a nested
    region's body counted once)."""
    return sum(node.op == "call_function" and node.target is fused_grouped_mlp
               for module, _ in graph_modules(gm) for node in module.graph.nodes)


def traces_launches(gm: torch.fx.GraphModule, options: BackendOptions) -> bool:
    """Whether a rewritten graph's fused ops become kernel launches in Inductor's generated
    code: ``trace_launches`` and a site whose plan's target inlines (target_ops.py)."""
    if not options.trace_launches:
        return False
    targets = {node.kwargs.get("target") for module, _ in graph_modules(gm) for node in module.graph.nodes
               if node.op == "call_function" and node.target is fused_grouped_mlp}
    return any(get_target(name).inline() for name in targets if name is not None)


CPP_WRAPPER_REFUSED = (
    "nvfp4 backend: torch._inductor.config.cpp_wrapper is set, but graphs whose grouped MLP runs "
    "as traced Triton launches compile with Inductor's Python wrapper. Our grouped GEMMs build "
    "their TMA descriptors on the GPU, in Triton's global scratch, and Inductor's C++ wrapper "
    "allocates one program's scratch for the whole launch: every other program would write out "
    "of bounds (an illegal memory access). Other graphs keep the C++ wrapper."
)


def _aot_eager(gm, example_inputs):
    """torch's ``aot_eager`` (AOTAutograd and Inductor's min-cut partition, graphs run as
    traced), each graph run after ``kernels.set_launch_allocator()`` in its own thread: its
    traced launches are ``wrap_triton`` calls, which set no Triton allocator, and the
    backward runs on autograd's thread, where the one set while tracing does not reach.

    The partition is Inductor's min-cut with our joint pre-pass, and each site's recompute
    is moved before its backward, so a checkpointed region is recomputed as under
    "inductor". (AOTAutograd's default partitioner in torch 2.11 refuses a checkpointed
    graph that holds a device-side assert, as our group-size check is on a GPU.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(fx_g, inputs):
        if hoist_site_recompute(fx_g.graph):  # as Inductor's post-grad pass does (``_HoistSiteRecompute``)
            fx_g.recompile()
        run = boxed_nop(fx_g, inputs)

        def call(args):
            kernels.set_launch_allocator()
            return run(args)

        call._boxed_call = True
        return call

    def partition(joint, joint_inputs, **kwargs):
        _RecomputeEmptyPlaceholders()(joint.graph)  # Inductor runs it as its joint pre-pass
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    return aot_autograd(fw_compiler=compiler, partition_fn=partition, keep_inference_input_mutations=True)(
        gm, example_inputs)


def inductor_patches(mode: Optional[str], options: BackendOptions, *, traced: bool = False) -> dict:
    """Inductor's config for our graphs: torch.compile's ``mode`` as stock Inductor takes
    it; the Python wrapper where the graph's fused ops are `traced` as launches and the
    user set Inductor's C++ wrapper (``CPP_WRAPPER_REFUSED`` says why; seen on the H200 with
    torch 2.11, docs/decisions.md "Host time", and 2.13's wrapper sizes the scratch the same
    way); this package's hash in Inductor's cache keys (``_ChainedPass``); the compile
    workers up before our kernels compile (``_WaitForCompileWorkers``); zero-size
    stand-in tensors made again in the backward, not saved
    (``_RecomputeEmptyPlaceholders``); each checkpointed site's recompute run before its
    backward (``_HoistSiteRecompute``); the user's own joint and post-grad passes run after
    ours; and the site call marked cacheable. AOTAutograd's
    cache takes a graph only if it trusts every function the graph calls;
    ``fused_grouped_mlp`` computes from its arguments (the site's options are constants in
    the graph's code) and this package's code, and it is traced as launches or as whole
    ops by ``trace_launches``: the key holds the package hash and that option. A later
    process compiling the same graph then loads the compiled forward and backward instead
    of tracing the fused ops again."""
    from torch._inductor import config, list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    if traced and config.cpp_wrapper:
        warnings.warn(CPP_WRAPPER_REFUSED, stacklevel=2)
        patches["cpp_wrapper"] = False
    patches["post_grad_custom_post_pass"] = _HoistSiteRecompute(
        then=_WaitForCompileWorkers(then=config.post_grad_custom_post_pass))
    patches["joint_custom_pre_pass"] = _RecomputeEmptyPlaceholders(then=config.joint_custom_pre_pass)
    patches["static_launch_user_defined_triton_kernels"] = True  # as in the workers: start_compile_workers
    patches["unsafe_marked_cacheable_functions"] = {
        **config.unsafe_marked_cacheable_functions,
        f"{fused_grouped_mlp.__module__}.{fused_grouped_mlp.__name__}":
            f"{_package_hash().hex()} trace_launches={options.trace_launches}",
    }
    return patches


def _on_gpu(values) -> bool:
    """Whether any of a graph's inputs is a CUDA tensor (where Inductor compiles with workers)."""
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values)


# Inductor's setting for launching user-written Triton kernels through its static launcher;
# a compile worker reads it from the environment it starts with (it decides the launcher)
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def start_compile_workers() -> None:
    """Start Inductor's pool of compile worker processes now, as the stock "inductor"
    backend does when Dynamo first calls it (``maybe_warm_pool``): the pool takes seconds
    to start, and until it is up Inductor compiles every kernel in this process, one after
    another (``AsyncCompile.use_process_pool``).

    The pool starts with Inductor's static launch of user-written kernels on (the same
    setting ``inductor_patches`` gives this process): each of our kernels is then launched
    from its binary by Inductor's launcher instead of a C launcher that Triton builds with
    gcc, in this process, one after another, when the compiled kernels are loaded (~0.2 s
    per kernel signature, 11 in a layer's step). A kernel Inductor cannot launch so (the
    TMA GEMMs, which need scratch memory) keeps Triton's launcher. A pool that was already
    running keeps its own setting."""
    from torch._inductor.async_compile import maybe_warm_pool

    before = os.environ.get(STATIC_LAUNCH_ENV)
    os.environ[STATIC_LAUNCH_ENV] = "1"
    try:
        maybe_warm_pool()
    finally:
        if before is None:
            del os.environ[STATIC_LAUNCH_ENV]
        else:
            os.environ[STATIC_LAUNCH_ENV] = before


def wait_for_compile_workers() -> None:
    """Wait until Inductor's compile workers are up (``_WaitForCompileWorkers`` says when).
    A pool that does not come up within Inductor's timeout leaves Inductor to compile in
    this process, as it would anyway."""
    from torch._inductor.async_compile import AsyncCompile

    start = time.perf_counter()
    try:
        AsyncCompile.wait_pool_ready()
    except Exception as error:  # noqa: BLE001 -- Inductor then compiles in this process, as before
        log.info("nvfp4: Inductor's compile workers did not start (%s); kernels compile in this process", error)
        return
    waited = time.perf_counter() - start
    if waited > 0.1:
        log.info("nvfp4: waited %.1f s for Inductor's compile workers to start", waited)


def _inner_compile(*args, **kwargs):
    """Inductor's compile of one graph (forward, or the backward when first called), with
    the traced launches analysed once (launch_analysis.py)."""
    from torch._inductor.compile_fx import compile_fx_inner

    which = "backward" if kwargs.get("is_backward") else "forward"
    launches, names = traced_kernels(args[0])
    if names:
        log.info("nvfp4: Inductor compiles the %s graph with %d launches of %d Triton kernels of ours; a cold "
                 "compile takes seconds to tens of seconds, a later process loads them from Inductor's and "
                 "Triton's caches", which, launches, len(names))
        log.debug("nvfp4: the %s graph's Triton kernels: %s", which, ", ".join(sorted(names)))
    start = time.perf_counter()
    with launches_analysed_once(), early_compile.compiling(which):
        compiled = compile_fx_inner(*args, **kwargs)
    if names:
        log.info("nvfp4: Inductor compiled the %s graph in %.1f s", which, time.perf_counter() - start)
    return compiled


def traced_kernels(gm: torch.fx.GraphModule) -> tuple[int, set[str]]:
    """(launches, the names of the kernels launched) of the traced Triton launches in a graph
    AOTAutograd gives Inductor: what Inductor compiles for the grouped MLPs, besides its own
    kernels for the rest of the graph."""
    from torch._higher_order_ops.triton_kernel_wrap import (kernel_side_table, triton_kernel_wrapper_functional,
                                                            triton_kernel_wrapper_mutation)

    indices = [node.kwargs["kernel_idx"] for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes if node.op == "call_function"  # nested regions' bodies too
               and node.target in (triton_kernel_wrapper_functional, triton_kernel_wrapper_mutation)]
    return len(indices), {_kernel_name(kernel_side_table.get_kernel(i)) for i in set(indices)}


def _kernel_name(kernel) -> str:
    while hasattr(kernel, "fn"):  # an Autotuner, then the JITFunction, then the Python function
        kernel = kernel.fn
    return getattr(kernel, "__name__", repr(kernel))


def nvfp4_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode=None):
    """``torch.compile(model, backend="nvfp4", options={"recipe": Recipe(...), "recompute": False})``."""
    return compile_graph(gm, example_inputs, BackendOptions.parse(options), mode=mode)


def backend(*, recipe: Optional[Recipe] = None, recompute: bool = True, compiler: str = "inductor",
            trace_launches: bool = True, reuse_weight_casts: bool = False, precision: Optional[Precision] = None,
            cudnn: str = "auto"):
    """A configured backend: ``torch.compile(model, backend=nvfp4_inductor.backend(...))``.
    Arguments as ``BackendOptions``; ``options=`` given to torch.compile override them.
    torch.compile's ``mode`` reaches Inductor (``check_mode``): ``mode="reduce-overhead"``
    runs the compiled graphs under CUDA graph trees, as with stock Inductor; each replay
    draws fresh stochastic-rounding seeds on the device (``numerics.draw_seed``)."""
    configured = BackendOptions.parse({"recipe": recipe or Recipe(), "recompute": recompute, "compiler": compiler,
                                       "trace_launches": trace_launches, "reuse_weight_casts": reuse_weight_casts,
                                       "precision": precision or Precision(), "cudnn": cudnn})

    def nvfp4_configured(gm, example_inputs, *, options=None, mode=None):
        given = {**{f.name: getattr(configured, f.name) for f in dataclasses.fields(configured)}, **(options or {})}
        return compile_graph(gm, example_inputs, BackendOptions.parse(given), mode=mode)

    nvfp4_configured.options = configured  # what inspection.py's tools compile with
    return nvfp4_configured


def register() -> None:
    """Register "nvfp4" with Dynamo unless the entry point or an earlier import did."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._BACKENDS and BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(nvfp4_backend, name=BACKEND_NAME)
