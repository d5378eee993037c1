"""Scale-out (docs/distributed.md): FSDP2, expert parallelism and DTensor with the nvfp4
backend, and rank-aware stochastic rounding, in real process groups.

One launch runs every scenario of ``distributed_scenarios.py`` in 2 processes (gloo, CPU;
``compiler="aot_eager"`` except one Inductor case), so torch's import and each compile are
paid once per process; each test below reads its scenario's verdict from every rank. The
2-D mesh scenarios (expert parallelism inside FSDP2) run in a second launch of 4 processes.
``pytest -m gpu`` runs them with world size 1 over NCCL and, on a machine with two or more
GPUs, in 2 ranks over NCCL (one GPU a rank); the mesh scenarios in 4 ranks where 4 GPUs exist.
"""

import pytest
import torch
import torch.distributed as dist

import distributed_scenarios as scenarios

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    return scenarios.launch(2, tmp_path_factory.mktemp("dist_cpu"), device="cpu", timeout=300)


def _verdict(results: dict, name: str) -> None:
    absent = scenarios.missing(name)
    if absent:
        pytest.skip(f"{name} needs {', '.join(absent)} (the test extra)")
    failed = {rank: r[name]["detail"] for rank, r in results.items() if not r.get(name, {}).get("ok")}
    assert not failed, "\n".join(f"rank {rank}: {detail}" for rank, detail in failed.items())


@pytest.mark.parametrize("name", scenarios.SCENARIOS)
def test_two_ranks_on_cpu(cpu_results, name):
    _verdict(cpu_results, name)


@pytest.fixture(scope="module")
def cpu_mesh_results(tmp_path_factory):
    return scenarios.launch(4, tmp_path_factory.mktemp("dist_cpu_mesh"), device="cpu",
                            scenarios=scenarios.MESH_SCENARIOS, timeout=300)


@pytest.mark.parametrize("name", scenarios.MESH_SCENARIOS)
def test_four_ranks_on_cpu(cpu_mesh_results, name):
    _verdict(cpu_mesh_results, name)


def _nccl(world: int, out_dir, names) -> dict:
    if torch.cuda.device_count() < world or not dist.is_nccl_available():
        pytest.skip(f"needs {world} CUDA device(s) and NCCL")
    return scenarios.launch(world, out_dir, device="cuda", scenarios=names, timeout=900)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def nccl_results(request, tmp_path_factory):
    """Every scenario over NCCL, one GPU a rank: world size 1 on any CUDA machine, 2 where
    two GPUs exist."""
    world = request.param
    return _nccl(world, tmp_path_factory.mktemp(f"dist_nccl{world}"), scenarios.SCENARIOS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", scenarios.SCENARIOS)
def test_over_nccl(nccl_results, name):
    _verdict(nccl_results, name)


@pytest.fixture(scope="module")
def nccl_mesh_results(tmp_path_factory):
    return _nccl(4, tmp_path_factory.mktemp("dist_nccl_mesh"), scenarios.MESH_SCENARIOS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", scenarios.MESH_SCENARIOS)
def test_mesh_over_nccl(nccl_mesh_results, name):
    _verdict(nccl_mesh_results, name)
