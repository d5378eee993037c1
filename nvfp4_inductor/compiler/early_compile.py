"""Our kernels compiled as soon as a graph's grouped MLPs are known, not when Inductor asks.

Inductor compiles the kernels a graph launches when it loads the graph's generated code:
the forward's after AOTAutograd's two traces and the post-grad passes, the backward's at
its first call, after the forward's kernels have compiled and run. Our slowest kernels
take 3-7 s each to compile on an H100 (docs/performance.md), so a cold first step waited
for them twice, one graph after the other, each time after seconds of tracing.

Here, right after the rewrite (``start``), each site's forward and backward op bodies run
on fake tensors: they launch nothing but name every kernel, grid and argument
(``kernels._registry.recording_launches``). Each launch becomes the source Inductor's
wrapper writes for it -- Inductor's own ``define_user_defined_triton_kernel``, run on a
stand-in graph whose tensors are graph inputs -- and is compiled, the forward's first: on a
few threads of this process while Inductor's compile workers start (seconds, when the
slowest kernels are already known), then in the workers, which also take each kernel
compiled here (a cache hit for them, ``_use_the_workers_tools``).
When Inductor later compiles that kernel, Triton's cache has it: Triton keys a binary on
the kernel's source and its line in the file, its signature, its specialisation (pointer
alignment, integers divisible by 16 or equal to 1) and its launch options, all the same
here. Only the decorator's metadata differs (the kernel's name within the graph), which
Triton does not read.

Before Inductor generates a graph's code, the backend's last post-grad pass waits for the
early compiles of that graph's phase where Inductor will ask for them, here or in the
workers (``wait``): Inductor's request then finds the binary,
instead of compiling the kernel again beside an early compile still under way. Each source
is submitted once per process; in a process whose Triton cache is warm, the workers only
load the binaries.

A site whose shapes are symbolic (dynamic shapes) or whose inputs are tensor subclasses
(DTensors, whose local shards the example values do not give) is left to Inductor, as is
every kernel where Inductor has no compile workers (``compile_threads`` 1: compiles one at a
time, in this process, as asked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import time
from concurrent.futures import Future
from typing import Any, Iterator, Optional

import torch

from .nodes import val

log = logging.getLogger(__name__)

FORWARD, BACKWARD = "forward", "backward"


@dataclasses.dataclass(eq=False)
class _Job:
    """One source's early compile: `here` is done once it compiled in this process (if it
    did), `workers` once a worker has its binary (compiled there, or found in Triton's cache
    where the one compiled here has the worker's key)."""

    name: str
    source: str
    here: Future = dataclasses.field(default_factory=Future)
    workers: Future = dataclasses.field(default_factory=Future)


_submitted: dict[str, _Job] = {}  # source -> its job (once per process)
_pending: dict[str, list[_Job]] = {FORWARD: [], BACKWARD: []}  # phase -> the jobs its graph needs
_phase: Optional[str] = None  # the phase of the graph Inductor compiles now (``compiling``)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch, as torch's tracing hands it to Inductor: the kernel (a one-config
    Autotuner where the launch passed num_warps / num_stages), its grid and its arguments."""

    phase: str
    kernel: Any
    grid: tuple
    kwargs: dict


# ---------------------------------------------------------------------------------------
# Recording a site's launches


def _fake_like(value, mode):
    if not isinstance(value, torch.Tensor):
        return value
    with mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device,
                                   requires_grad=value.requires_grad)


def _describe(value):
    """A site argument as its launches depend on it."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.requires_grad
    return value


def _subclass(value) -> bool:
    """A tensor subclass (a DTensor): its launches run on its local shards, whose shapes
    the example value does not give."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)


def _symbolic(value) -> bool:
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def site_launches(node: torch.fx.Node, *, grad: bool) -> Optional[list[Launch]]:
    """The launches of one rewritten site (a ``fused_grouped_mlp`` call node): its forward
    op's body, and where `grad` is on and an input needs a gradient (as
    ``fused_grouped_mlp`` decides) the backward ops' bodies, run on fake tensors shaped
    like the node's example values. None where a shape is symbolic or an input is a tensor
    subclass."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..kernels._registry import recording_launches
    from ..saved import SavedForBackward
    from ..target_ops import bodies_run
    from .fused import (fused_grouped_mlp, grouped_mlp_bwd, grouped_mlp_fwd, grouped_mlp_infer, schema_kwargs,
                        site_options_from)

    values = [val(a) for a in node.args]
    if any(_symbolic(v) or _subclass(v) for v in values):
        return None
    bound = inspect.signature(fused_grouped_mlp).bind(*values, **node.kwargs)
    bound.apply_defaults()
    opts = site_options_from(bound.arguments)
    options = schema_kwargs(opts)
    mode = FakeTensorMode()
    x, w1, w2, sizes, probs, *sources = (_fake_like(v, mode) for v in values)
    grad = grad and any(t is not None and t.requires_grad for t in (x, w1, w2, probs))
    out = []
    with mode, bodies_run(), torch.no_grad():
        with recording_launches() as forward:
            op = grouped_mlp_fwd if grad else grouped_mlp_infer
            result = op(x, w1, w2, sizes, probs, *sources, **options)
        out += [Launch(FORWARD, *_as_traced(*launch)) for launch in forward]
        if grad:
            y, *saved = result
            with recording_launches() as backward:
                grouped_mlp_bwd(torch.empty_like(y), SavedForBackward.unflatten(saved), probs, sizes, opts)
            out += [Launch(BACKWARD, *_as_traced(*launch)) for launch in backward]
    return out


def _as_traced(kernel, grid, kwargs) -> tuple:
    """(kernel, grids, arguments) as torch's tracing of ``wrap_triton(kernel)[grid](**kwargs)``
    hands them to Inductor: launch options moved into a one-config Autotuner, constexprs
    specialised, grids made 3-D (torch's own code, up to where it would emit the launch)."""
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper, TracingTritonHOPifier

    class Capture(TracingTritonHOPifier):
        def call_HOP(self, variable, grids, combined_args, tx):
            return variable.kernel, tuple(grids), combined_args

    return Capture().call_triton_kernel(TraceableTritonKernelWrapper(kernel, None, grid), (), dict(kwargs), None)


# ---------------------------------------------------------------------------------------
# The source Inductor writes for a launch


@contextlib.contextmanager
def _stand_in_graph(device: torch.device) -> Iterator[Any]:
    """An empty Inductor graph to generate launches' sources in, its wrapper's kernel
    definitions captured instead of written: yields (graph, wrapper, captured)."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    fx_graph = torch.fx.Graph()
    fx_graph.output(None)
    graph = GraphLowering(torch.fx.GraphModule({}, fx_graph))
    with V.set_graph_handler(graph), graph.set_current_device(device):
        wrapper = PythonWrapperCodegen.create(False, None, None, None)
        captured: list[str] = []
        wrapper.define_kernel = lambda name, body, *args, **kwargs: captured.append(body)
        yield graph, wrapper, captured


def _ir_argument(graph, name: str, value):
    """`value` as Inductor's IR holds a launch argument: a tensor as a graph input (or a view
    into one at its storage offset), anything else as is."""
    from torch._inductor import ir

    if not isinstance(value, torch.Tensor):
        return value
    offset = value.storage_offset()
    layout = ir.FixedLayout(value.device, value.dtype, list(value.shape), list(value.stride()))
    buffer = ir.InputBuffer(name=f"early_{name}", layout=layout)
    graph.graph_inputs[buffer.get_name()] = ir.TensorBox.create(buffer)
    if offset == 0:
        return buffer
    view = ir.FixedLayout(value.device, value.dtype, list(value.shape), list(value.stride()), offset=offset)
    return ir.ReinterpretView(data=buffer, layout=view)


def _source_key(launch: Launch) -> tuple:
    """What the source Inductor writes for a launch depends on: the kernel and its launch
    options, the constexprs' values, each tensor's dtype and 16-byte alignment, each other
    integer's width, divisibility by 16 and equality to 1 (Triton's specialisation), a
    float's type. The grid's and the integers' values are arguments of the call only."""
    from triton.runtime.autotuner import Autotuner

    from .launch_analysis import int_specialisation

    kernel = launch.kernel
    options = ()
    if isinstance(kernel, Autotuner):
        options = tuple(repr(sorted(vars(config).items())) for config in kernel.configs)
        kernel = kernel.fn
    constexprs = {p.name for p in kernel.params if p.is_constexpr}

    def spec(name, value):
        if isinstance(value, torch.Tensor):
            return value.dtype, value.storage_offset() * value.element_size() % 16 == 0
        if name in constexprs or value is None or isinstance(value, bool):
            return type(value), value
        if isinstance(value, int):
            return int, int_specialisation(value)
        return (type(value),)

    return kernel, options, tuple((name, spec(name, value)) for name, value in launch.kwargs.items())


def inductor_source(launch: Launch, device: torch.device) -> tuple[str, str]:
    """(kernel name, source) of ``async_compile.triton`` for `launch`, as Inductor's Python
    wrapper writes it (its own code on a stand-in graph)."""
    from triton.runtime.autotuner import Autotuner

    kernel, configs, restore, reset = launch.kernel, [], [], []
    if isinstance(kernel, Autotuner):  # as ir.UserDefinedTritonKernel.get_kernel_and_metadata
        configs, restore, reset = kernel.configs, list(kernel.restore_value), list(kernel.reset_to_zero)
        kernel = kernel.fn
    with _stand_in_graph(device) as (graph, wrapper, captured):
        kwargs = {name: _ir_argument(graph, name, value) for name, value in launch.kwargs.items()}
        define = wrapper.define_user_defined_triton_kernel
        extra = {"epilogue_fusion": None} if "epilogue_fusion" in inspect.signature(define).parameters else {}
        define(kernel, configs, kwargs, restore, reset, [list(g) for g in launch.grid], **extra)
    calls = []

    class AsyncCompile:  # the generated line's call, evaluated: the exact strings Inductor passes
        def triton(self, name, source, device_str="cuda"):
            calls.append((name, source))

    (body,) = captured
    eval(body, {"async_compile": AsyncCompile()})  # noqa: S307 -- Inductor's own generated call
    return calls[0]


# ---------------------------------------------------------------------------------------
# Submitting, and waiting


def workers_available() -> bool:
    """Whether Inductor compiles in worker processes here (``compile_threads`` > 1)."""
    from torch._inductor.async_compile import get_compile_threads

    return get_compile_threads() > 1


def _submit(name: str, source: str) -> Future:
    """Compile `source` in one of Inductor's workers, as ``AsyncCompile.triton`` does on a
    miss of its in-process table."""
    from torch._inductor import config
    from torch._inductor.async_compile import (AsyncCompile, _load_triton_kernel_from_source,
                                               _worker_compile_triton)

    env = {v: os.environ[v] for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if v in os.environ}
    extra_config = {"use_static_triton_launcher": config.use_static_triton_launcher}
    load = functools.partial(_load_triton_kernel_from_source, name, source)
    return AsyncCompile.process_pool().submit(_worker_compile_triton, load, env, extra_config)


def _compile_here(name: str, source: str) -> None:
    """Compile `source` in this process, as a worker would: the binary lands in Triton's
    cache and nothing else is kept. The source runs in a module of its own, not in the one
    Inductor's code cache shares (loaded by Inductor's loader, kept out of ``sys.modules``),
    so that Inductor's own load of it later makes a fresh kernel and chooses its launcher
    under its own settings. Its file is the one Inductor writes (``PyCodeCache.write``):
    Triton's key holds the kernel's line in it. Triton's optimisation passes, most of a
    slow compile, run without the GIL (a 5.2 s compile beside a busy Python thread slowed
    that thread by a quarter on a 2-core CPU)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime import compile_tasks

    key, path = PyCodeCache.write(source)
    module = compile_tasks._reload_python_module(key, path, set_sys_modules=False)  # Inductor's loader
    getattr(module, name).precompile(warm_cache_only=True)


def _use_the_workers_tools() -> None:
    """Have Triton in this process use the ptxas (and, in torch 2.13, libdevice) that
    Inductor's workers set before they compile anything, so that a binary compiled here has
    the key a worker would give it. Triton keys a binary on the ptxas version it finds
    first in a process and keeps that answer; here the first to ask is Inductor's own code
    generation (its backend hash, in ``inductor_source``). Left to itself, this process
    would find Triton's bundled ptxas, and the workers torch's, where torch ships one (an
    H100 compiled 8 kernels twice, 2026-12-06). Inductor sets the same paths here before it
    compiles in this process."""
    from torch._inductor.runtime import compile_tasks

    compile_tasks._set_triton_ptxas_path()
    getattr(compile_tasks, "_set_triton_libdevice_path", lambda: None)()  # (torch 2.13 only)


def _pool_up() -> Future:
    """A Future done when Inductor's compile workers run jobs (a no-op job's result)."""
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile.process_pool().submit(int)


# Compile threads in this process while Inductor's workers start: enough for the few
# slowest kernels (the casts and the fused GEMMs, 2-7 s each on an H100 host), which the
# forward would otherwise wait for (the workers took 9 s to start there, 2026-12-06)
HERE_MAX = 4


def _compile_all(jobs: list[_Job], marker: str, pool_up: Future, here: int) -> None:
    """Compile the jobs, in their order: on `here` threads of this process until the
    workers are up (`pool_up`), then the rest in the workers. A job compiled here is handed
    to the workers too once they are up: a cache hit where its key is theirs, their own
    compile where something else in this process made Triton key it otherwise, so that
    ``wait`` can wait for the binary wherever Inductor will ask. Once every job is in the
    workers, leave `marker` in Triton's cache. Runs on a thread of its own: the workers'
    pipe takes a job only as fast as the pool reads it, and the pool is still starting when
    the first graph arrives (the main thread blocked 4.4 s on it on an H100, 2026-12-06).
    As each worker's compile comes back, this thread builds the Triton launchers its
    binaries need (``_build_triton_launchers``) before the job counts as done, so that
    ``wait`` covers them too. If the workers do not start, the threads here compile every
    job."""
    import collections
    import queue as queues
    import threading

    from triton.runtime.cache import get_cache_manager

    queue, lock = collections.deque(jobs), threading.Lock()
    compiled_here: list[_Job] = []  # not yet handed to the workers
    handed = threading.Event()  # (set, and read by the threads here, under the lock)
    returned: queues.SimpleQueue = queues.SimpleQueue()  # (job, the worker's Future) as each comes back
    start_time = time.perf_counter()

    def take() -> Optional[_Job]:
        with lock:
            return queue.popleft() if queue else None

    def workers_up() -> bool:
        return pool_up.done() and pool_up.exception() is None

    def to_workers(job: _Job) -> None:
        try:
            compiled = _submit(job.name, job.source)
        except Exception as error:  # noqa: BLE001 -- Inductor then compiles it, and reports
            compiled = Future()
            compiled.set_exception(error)
        compiled.add_done_callback(lambda done: returned.put((job, done)))

    def compile_here() -> None:
        # (not a daemon: a compile is native code, which a daemon thread must not be in when
        # the interpreter exits; at exit, the main thread is no longer alive and the thread
        # stops after the compile in hand)
        while threading.main_thread().is_alive() and not workers_up() and (job := take()) is not None:
            try:
                _compile_here(job.name, job.source)
            except Exception as error:  # noqa: BLE001 -- Inductor then compiles it, and reports
                job.here.set_exception(error)
            else:
                job.here.set_result(None)
            with lock:
                late = handed.is_set()
                if not late:
                    compiled_here.append(job)
            if late:
                to_workers(job)

    # not daemons (compile_here says why), though made by one, whose kind they would inherit
    threads = [threading.Thread(target=compile_here, name="nvfp4-early-compile-here", daemon=False)
               for _ in range(here)]
    for thread in threads:
        thread.start()
    failed = launchers = 0
    if pool_up.exception() is None:  # (waits for the workers)
        with lock:
            handed.set()
            waiting, compiled_here[:] = compiled_here[:] + list(queue), []
            queue.clear()
        for job in waiting:
            to_workers(job)
        for _ in jobs:  # each job once, in the order the workers finish them (a thread here may still compile)
            job, done = returned.get()
            if done.exception() is None:
                try:
                    launchers += _build_triton_launchers(done.result())
                except Exception as error:  # noqa: BLE001 -- Inductor's load builds it again, and reports
                    log.debug("nvfp4: Triton's launchers for %s were not built early: %s", job.name, error)
                job.workers.set_result(None)
            else:
                failed += 1
                job.workers.set_exception(done.exception())
    for thread in threads:
        thread.join()
    done_here = sum(job.here.done() for job in jobs)  # (only the threads here complete `here`)
    if not workers_up():
        for job in jobs:  # (``wait`` then takes the compiles here)
            job.workers.set_exception(RuntimeError("Inductor's compile workers did not start"))
        log.info("nvfp4: Inductor's workers did not start; %d early compiles ran in this process", done_here)
        return
    log.info("nvfp4: early compiles done in %.1f s: %d in this process while Inductor's workers started, all "
             "in the workers; %d Triton launcher(s) built", time.perf_counter() - start_time, done_here, launchers)
    if not failed:
        get_cache_manager(marker).put(b"", MARKER)


def _build_triton_launchers(compiled) -> int:
    """Build Triton's C launcher for each binary of `compiled` (a worker's result: Inductor's
    kernel and its compile time) that Inductor will launch through Triton rather than its
    static launcher; returns how many. The worker decided which, and Inductor's load of the
    kernel keeps that decision: the TMA GEMMs, whose scratch memory the static launcher does
    not support. Triton 3.6 (torch 2.11) builds a launcher with gcc (0.3-0.8 s) when a
    binary is first loaded and keys it in its cache on the launcher's C source, which
    depends only on the kernel's signature and constants: built here, on the early
    compiles' thread, it is a cache hit for Inductor's load on the main thread. (Triton 3.9
    launches every kernel through one prebuilt launcher: there this costs nothing.)"""
    from torch._inductor.runtime.triton_heuristics import TritonCompileResult
    from triton.runtime import driver

    kernel, _ = compiled
    binaries = [result.kernel for result in kernel.compile_results if isinstance(result, TritonCompileResult)]
    for binary in binaries:
        driver.active.launcher_cls(binary.src, binary.metadata)
    return len(binaries)


# A file in Triton's cache, under a key made of a graph's sites (``_marker_key``): their
# kernels' binaries are in this cache, so a later process submits nothing early
MARKER = "nvfp4_early_compile.done"


def _marker_key(sites: list[tuple], device: torch.device) -> str:
    """What the sources of `sites` depend on beyond the sites themselves: this package's
    code, torch's and Triton's versions, the device. (Inductor settings that change the
    source, such as its assertion option, are not in it: with them changed, Inductor
    compiles the kernels when it asks, as without early compiles.)"""
    import hashlib

    import triton

    from .backend import _package_hash

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    text = repr((_package_hash().hex(), torch.__version__, triton.__version__, capability, sorted(map(repr, sites))))
    return hashlib.sha256(f"nvfp4 early compile {text}".encode()).hexdigest()  # (Triton takes hex keys)


def _compiled_before(key: str) -> bool:
    from triton.runtime.cache import get_cache_manager

    return get_cache_manager(key).get_file(MARKER) is not None


def start(gm: torch.fx.GraphModule, device: torch.device, *, grad: bool) -> int:
    """Hand the kernels of every rewritten site in `gm` (and its nested bodies) to the
    compile workers; returns how many compiles it started: none for sources submitted
    before in this process, none at all where Triton's cache holds this graph's marker."""
    import threading

    from .fused import fused_grouped_mlp
    from .rewrite import graph_modules

    start_time = time.perf_counter()
    sites = {}  # description -> node: layers of one shape launch the same kernels
    for module, _ in graph_modules(gm):
        for node in module.graph.find_nodes(op="call_function", target=fused_grouped_mlp):
            sites.setdefault((tuple(_describe(val(a)) for a in node.args), tuple(sorted(node.kwargs.items())),
                              grad), node)
    marker = _marker_key(list(sites), device)
    if not sites or _compiled_before(marker):
        return 0
    _use_the_workers_tools()
    sources: dict[tuple, tuple[str, str]] = {}
    jobs, first_needed = [], {}  # (first_needed: job -> the phase that needs it first)
    launches = 0
    for node in sites.values():
        recorded = site_launches(node, grad=grad)
        if recorded is None:
            log.info("nvfp4: a site's shapes are symbolic or its inputs tensor subclasses; Inductor compiles its "
                     "kernels when it asks")
            continue
        for launch in recorded:
            launches += 1
            key = _source_key(launch)
            if key not in sources:
                sources[key] = inductor_source(launch, device)
            name, source = sources[key]
            job = _submitted.get(source)
            if job is None:
                job = _submitted[source] = _Job(name, source)
                jobs.append(job)
                first_needed[job] = launch.phase
            _pending[launch.phase].append(job)
    if jobs:
        from torch._inductor.async_compile import get_compile_threads

        pool_up = _pool_up()  # (makes the pool here: its first call is not thread-safe)
        here = min(HERE_MAX, max(1, get_compile_threads() // 4))
        # the forward's kernels first (its graph waits for them first), the longest sources
        # first within a phase (the straight-line casts compile slowest); a job beyond the
        # threads' and workers' count waits for a free one
        jobs.sort(key=lambda job: (first_needed[job] != FORWARD, -len(job.source)))
        threading.Thread(target=_compile_all, args=(jobs, marker, pool_up, here), name="nvfp4-early-compile",
                         daemon=True).start()
    if launches:
        log.info("nvfp4: %d of our kernels' compiles started early (%d launches) in %.2f s", len(jobs), launches,
                 time.perf_counter() - start_time)
    return len(jobs)


@contextlib.contextmanager
def compiling(phase: str) -> Iterator[None]:
    """Inductor compiles a graph of `phase` inside the block (``wait`` waits for its kernels)."""
    global _phase
    before, _phase = _phase, phase
    try:
        yield
    finally:
        _phase = before


def wait() -> None:
    """Wait for the early compiles of the phase being compiled (all phases outside
    ``compiling``), each where Inductor will look for it: in the workers once Inductor
    compiles there (``AsyncCompile.use_process_pool``), else here or there, whichever has it
    first. A failed compile is left to Inductor, which compiles the kernel again and reports
    its error."""
    from concurrent.futures import FIRST_COMPLETED
    from concurrent.futures import wait as wait_all

    from torch._inductor.async_compile import AsyncCompile

    phases = [_phase] if _phase is not None else list(_pending)
    jobs = list(dict.fromkeys(job for phase in phases for job in _pending[phase]))  # launches share them
    for phase in phases:
        _pending[phase] = []
    if not jobs:
        return
    start_time = time.perf_counter()
    in_workers = AsyncCompile.use_process_pool()
    for job in jobs:
        if in_workers:
            wait_all([job.workers])
        elif job.workers.done() and job.workers.exception() is not None:  # not in the workers: here, then
            wait_all([job.here])
        else:
            wait_all([job.here, job.workers], return_when=FIRST_COMPLETED)
    waited = time.perf_counter() - start_time
    if waited > 0.1:
        log.info("nvfp4: waited %.1f s for %d early kernel compiles", waited, len(jobs))
