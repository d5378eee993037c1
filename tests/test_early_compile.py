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
    source then finds it: no binary is added. Every compile succeeded, so the marker is left."""
    here = scenario["here"]
    assert here["done"] == [True, True, True]
    assert here["binaries"] == here["binaries_after_inductor"] == 3
    assert here["marker"]


def _jobs(n):
    from concurrent.futures import Future

    return [(f"k{i}", f"source {i}", Future()) for i in range(n)]


def test_compiles_run_here_until_the_workers_are_up_then_go_to_them(monkeypatch, tmp_path):
    """One thread here takes the longest job; the workers come up while it compiles, so it
    takes no other, and the rest go to the workers. Each job's Future gets its result."""
    from concurrent.futures import Future

    from nvfp4_inductor.compiler import early_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pool_up, here, submitted = Future(), [], []

    def compile_here(name, source):
        here.append(name)
        pool_up.set_result(0)  # the workers come up during the first compile

    def submit(name, source):
        submitted.append(name)
        done = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(early_compile, "_compile_here", compile_here)
    monkeypatch.setattr(early_compile, "_submit", submit)
    jobs = _jobs(5)
    early_compile._compile_all(jobs, "1" * 64, pool_up, here=1)
    assert here == ["k0"] and submitted == ["k1", "k2", "k3", "k4"]
    assert all(future.done() and future.exception() is None for _, _, future in jobs)
    assert early_compile._compiled_before("1" * 64)


def test_workers_that_do_not_start_leave_every_compile_here(monkeypatch, tmp_path):
    """If the workers fail to start, the threads here compile every job; a compile that
    fails here is passed on to its Future (Inductor compiles that kernel again and reports),
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
    assert [future.exception() is None for _, _, future in jobs] == [True, True, False, True]
    assert not early_compile._compiled_before("2" * 64)


EXIT = """
import sys, threading, time
from concurrent.futures import Future
from nvfp4_inductor.compiler import early_compile

def slow(name, source):
    print(name, flush=True)
    time.sleep(0.5)
    print(name + "-done", flush=True)

early_compile._compile_here = slow
jobs = [(f"k{i}", "source", Future()) for i in range(6)]
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


def test_wait_waits_for_its_phase_and_survives_a_failed_compile(monkeypatch):
    """``wait`` inside ``compiling(phase)`` takes that phase's compiles only; a compile that
    failed is left to Inductor (which compiles it again and reports), not raised here."""
    from concurrent.futures import Future

    from nvfp4_inductor.compiler import early_compile

    ok, failed, later = Future(), Future(), Future()
    ok.set_result(None)
    failed.set_exception(RuntimeError("ptxas died"))
    monkeypatch.setattr(early_compile, "_pending", {early_compile.FORWARD: [("a", ok), ("b", failed)],
                                                    early_compile.BACKWARD: [("c", later)]})
    with early_compile.compiling(early_compile.FORWARD):
        early_compile.wait()  # returns: "c" is the backward's, still running
    assert early_compile._pending == {early_compile.FORWARD: [], early_compile.BACKWARD: [("c", later)]}


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
