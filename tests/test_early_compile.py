"""compiler/early_compile.py: a graph's kernels handed to Inductor's compile workers at the
rewrite, before AOTAutograd traces (on a stand-in H100, in a child process:
tests/early_compile_scenarios.py). Whether the sources meet Triton's cache keys of
Inductor's own compile is checked on a GPU (test_gpu_end_to_end.py)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=["srelu", "swiglu"])
def scenario(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
    out = tmp / "out.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "early_compile_scenarios.py"), request.param,
                          str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_bodies_name_the_launches_aotautograd_traces(scenario):
    """Run untraced on fake tensors, a site's forward and backward bodies launch exactly the
    kernels, with the launch options and argument specialisations, that AOTAutograd's traces
    of the same ops hold, phase by phase."""
    assert scenario["recorded"] == scenario["traced"]
    assert {phase for phase, *_ in scenario["recorded"]} == {"forward", "backward"}


def test_each_distinct_source_is_submitted_once_then_the_cache_marker_stops_it(scenario):
    """Two layers of one shape submit each distinct kernel source once: as many as the
    binaries Triton's own binder tells the traced launches apart into, the forward's first;
    waiting in the forward's compile leaves the backward's compiles pending; and with the
    marker in Triton's cache a new start submits nothing."""
    assert scenario["started"] == len(scenario["submitted"]) == scenario["distinct_sources"] == scenario["variants"]
    pending = scenario["pending_after_forward"]
    assert pending["forward"] == 0 and pending["backward"] > 0
    assert scenario["started_again"] == 0
    in_forward = scenario["submitted_forward"]  # the forward's kernels go first: its graph waits first
    assert in_forward == sorted(in_forward, reverse=True) and True in in_forward and False in in_forward


def test_the_workers_ptxas_is_set_before_inductors_code_generation_asks(scenario):
    """Triton keys a binary on the first ptxas version a process finds; Inductor's workers
    set torch's ptxas first, so ``start`` does so before generating any source (whose
    backend hash asks Triton for that version), and a binary compiled here has a worker's key."""
    assert scenario["first_events"] == ["ptxas", "source"]


def test_a_source_is_inductors_wrapper_code_for_the_kernel(scenario):
    """The source is what Inductor's wrapper writes for a user-written kernel: its common
    imports, the user_autotune decorator with the launch's signature and options, then the
    kernel's own text."""
    source, kernel_src = scenario["first_source"], scenario["kernel_src"]
    assert "@triton_heuristics.user_autotune(" in source and "custom_kernel=True" in source
    assert "'signature': {" in source and "'num_warps':" in source
    assert kernel_src.strip() in source


def test_a_compile_here_leaves_the_binary_inductors_own_load_finds(scenario):
    """Compiled in this process while the workers start (here they never do), each source
    leaves one binary in Triton's cache, and Inductor's own load and compile of the same
    source then finds it: no binary is added. Nothing reached the workers."""
    here = scenario["here"]
    assert here["done"] == [True, True, True]
    assert here["binaries"] == here["binaries_after_inductor"] == 3
    assert here["in_workers"] == [False, False, False]


def _jobs(n):
    from nvfp4_inductor.compiler import early_compile

    return [early_compile._Job(f"k{i}", f"source {i}") for i in range(n)]


def _done(value=None):
    from concurrent.futures import Future

    future = Future()
    future.set_result(value)
    return future


def test_compiles_run_here_until_the_workers_are_up_then_all_go_to_them(monkeypatch, tmp_path):
    """One thread here takes the first job; the workers come up while it compiles, so it
    takes no other. Every job then goes to the workers, the one compiled here too (a cache
    hit there where its key is theirs), and once all are there the marker is left."""
    from concurrent.futures import Future

    from nvfp4_inductor.compiler import early_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pool_up, here, submitted = Future(), [], []

    def compile_here(name, source):
        here.append(name)
        pool_up.set_result(0)  # the workers come up during the first compile

    monkeypatch.setattr(early_compile, "_compile_here", compile_here)
    monkeypatch.setattr(early_compile, "_submit", lambda name, source: submitted.append(name) or _done(_worker_result()))
    jobs = _jobs(5)
    early_compile._compile_all(jobs, "1" * 64, pool_up, here=1)
    assert here == ["k0"] and sorted(submitted) == ["k0", "k1", "k2", "k3", "k4"]
    assert jobs[0].here.done() and not any(job.here.done() for job in jobs[1:])
    assert all(job.workers.done() and job.workers.exception() is None for job in jobs)
    assert early_compile._compiled_before("1" * 64)


def _worker_result(*kinds):
    """What a worker returns for a kernel (Inductor's ``_worker_compile_triton``): the kernel,
    whose compile results are of `kinds`, and its compile time."""
    from types import SimpleNamespace

    results = []
    for kind in kinds:
        result = kind.__new__(kind)
        result.kernel = SimpleNamespace(src=f"src of {kind.__name__} {len(results)}", metadata="metadata")
        results.append(result)
    return SimpleNamespace(compile_results=results), 1000


def test_triton_launchers_are_built_for_the_binaries_inductor_launches_through_triton(monkeypatch):
    """Of a worker's compile results, those Inductor launches through Triton's launcher (not
    its static one) get the launcher built here, from the binary's own source and metadata."""
    from types import SimpleNamespace

    from torch._inductor.runtime.triton_heuristics import StaticTritonCompileResult, TritonCompileResult
    from triton.runtime import driver

    from nvfp4_inductor.compiler import early_compile

    built = []
    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=lambda src, metadata: built.append(src)))
    compiled = _worker_result(StaticTritonCompileResult, TritonCompileResult)
    assert early_compile._build_triton_launchers(compiled) == 1
    assert built == ["src of TritonCompileResult 1"]
    assert early_compile._build_triton_launchers(_worker_result(StaticTritonCompileResult)) == 0


def test_a_job_is_done_once_its_triton_launchers_are_built(monkeypatch, tmp_path):
    """``wait`` sees a job done only after the launchers of its binary are built, so Inductor's
    load finds them; a build that fails leaves that launcher to Inductor's load, the job
    done, and the other jobs' builds going."""
    from nvfp4_inductor.compiler import early_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    jobs, seen = _jobs(3), []

    def build(compiled):
        kernel, _ = compiled
        job = jobs[int(kernel)]
        seen.append((job.name, job.workers.done()))
        if kernel == "1":
            raise RuntimeError("gcc died")
        return 1

    monkeypatch.setattr(early_compile, "_build_triton_launchers", build)
    monkeypatch.setattr(early_compile, "_submit", lambda name, source: _done((name[1:], 1000)))
    early_compile._compile_all(jobs, "4" * 64, _done(0), here=1)
    assert sorted(seen) == [("k0", False), ("k1", False), ("k2", False)]
    assert all(job.workers.done() and job.workers.exception() is None for job in jobs)
    assert early_compile._compiled_before("4" * 64)


def test_a_job_done_in_the_workers_is_done_while_a_thread_here_still_compiles(monkeypatch, tmp_path):
    """The workers come up while a thread here compiles the slowest kernel; the other jobs,
    compiled there meanwhile, count as done at once (a graph that needs only them does not
    wait for the compile here)."""
    from concurrent.futures import Future

    from nvfp4_inductor.compiler import early_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pool_up, jobs, seen = Future(), _jobs(3), []

    def compile_here(name, source):
        pool_up.set_result(0)
        seen.append(jobs[2].workers.result(timeout=10))

    monkeypatch.setattr(early_compile, "_compile_here", compile_here)
    monkeypatch.setattr(early_compile, "_submit", lambda name, source: _done(_worker_result()))
    early_compile._compile_all(jobs, "5" * 64, pool_up, here=1)
    assert seen == [None] and jobs[0].here.exception() is None


def test_workers_that_do_not_start_leave_every_compile_here(monkeypatch, tmp_path):
    """If the workers fail to start, the threads here compile every job; a compile that
    fails here is passed on to its job (Inductor compiles that kernel again and reports),
    and no marker is left."""
    from concurrent.futures import Future

    from nvfp4_inductor.compiler import early_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pool_up = Future()
    pool_up.set_exception(RuntimeError("no sidecar"))

    def compile_here(name, source):
        if name == "k2":
            raise RuntimeError("ptxas died")

    monkeypatch.setattr(early_compile, "_compile_here", compile_here)
    monkeypatch.setattr(early_compile, "_submit", lambda *args: pytest.fail("the workers are down"))
    jobs = _jobs(4)
    early_compile._compile_all(jobs, "2" * 64, pool_up, here=2)
    assert [job.here.exception() is None for job in jobs] == [True, True, False, True]
    assert all(job.workers.exception() is not None for job in jobs)  # nothing waits on them
    assert not early_compile._compiled_before("2" * 64)


@pytest.mark.parametrize("in_workers", [True, False])
def test_wait_waits_where_inductor_will_look(monkeypatch, in_workers):
    """Once Inductor compiles in its workers, ``wait`` waits for a job's binary there;
    before, a binary compiled here is enough (Inductor then compiles here, with this
    process's keys), and a job the workers could not take is waited for here. A failed
    compile is left to Inductor; only the phase being compiled is waited for."""
    import threading

    from torch._inductor.async_compile import AsyncCompile

    from nvfp4_inductor.compiler import early_compile

    monkeypatch.setattr(AsyncCompile, "use_process_pool", lambda: in_workers)
    compiled_here, failed, later, not_taken = _jobs(4)
    compiled_here.here.set_result(None)
    for future in (failed.here, failed.workers):  # left to Inductor, which reports it
        future.set_exception(RuntimeError("ptxas died"))
    monkeypatch.setattr(early_compile, "_pending", {early_compile.FORWARD: [compiled_here, failed, compiled_here],
                                                    early_compile.BACKWARD: [later]})
    returned = threading.Event()

    def forward():
        with early_compile.compiling(early_compile.FORWARD):
            early_compile.wait()
        returned.set()

    threading.Thread(target=forward, daemon=True).start()
    assert returned.wait(0.5) is not in_workers  # here's binary is enough only outside the workers
    compiled_here.workers.set_result(None)
    assert returned.wait(5)
    assert early_compile._pending == {early_compile.FORWARD: [], early_compile.BACKWARD: [later]}
    if not in_workers:  # a job the workers could not take is waited for here
        not_taken.workers.set_exception(RuntimeError("Inductor's compile workers did not start"))
        returned = threading.Event()
        monkeypatch.setattr(early_compile, "_pending", {early_compile.FORWARD: [not_taken], early_compile.BACKWARD: []})
        threading.Thread(target=forward, daemon=True).start()
        assert not returned.wait(0.5)
        not_taken.here.set_result(None)
        assert returned.wait(5)


EXIT = """
import os, threading, time
from concurrent.futures import Future
from nvfp4_inductor.compiler import early_compile

def slow(name, source):
    os.write(1, f"{name}\\n".encode())  # (one write a line: two threads print)
    time.sleep(0.5)
    os.write(1, f"{name}-done\\n".encode())

early_compile._compile_here = slow
jobs = [early_compile._Job(f"k{i}", "source") for i in range(6)]
threading.Thread(target=early_compile._compile_all, args=(jobs, "3" * 64, Future(), 2), daemon=True).start()
time.sleep(0.1)
"""


def test_at_exit_the_threads_here_stop_after_the_compile_in_hand(tmp_path):
    """The script ends while two threads compile here and the workers are not up: each
    finishes the compile in hand (a native compile must not be cut off by the exit), takes
    no other, and the process exits cleanly."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", EXIT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(run.stdout.split()) == ["k0", "k0-done", "k1", "k1-done"]


def test_a_failed_start_warns_and_leaves_the_kernels_to_inductor(monkeypatch):
    """The early compiles only shorten the first step: if they cannot start, the backend
    warns (naming the error) and compiles as without them."""
    import torch

    from nvfp4_inductor.compiler import backend, early_compile

    def broken(*args, **kwargs):
        raise RuntimeError("torch changed its wrapper")

    monkeypatch.setattr(early_compile, "start", broken)
    with pytest.warns(UserWarning, match="early compiles did not start .*torch changed its wrapper"):
        backend._start_early_compiles(torch.fx.GraphModule({}, torch.fx.Graph()))


def test_sites_it_cannot_record_are_left_to_inductor():
    """A site whose example values are not plain fake tensors (a DTensor's local shards are
    not what its value shows) or whose shapes are symbolic records nothing."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from nvfp4_inductor.compiler import early_compile, fused

    def site(x_value):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        x.meta["val"] = x_value
        return graph.call_function(fused.fused_grouped_mlp, (x, x, x, x, None), {})

    assert early_compile.site_launches(site(torch.empty(4, 8)), grad=True) is None  # not a fake tensor
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        symbolic = torch.empty(mode.shape_env.create_unbacked_symint(), 8)
    assert early_compile.site_launches(site(symbolic), grad=True) is None
