"""Scale-out (docs/distributed.md): FSDP2, expert parallelism and DTensor with the nvfp4
backend, and rank-aware stochastic rounding, in real process groups.

One launch runs every scenario of ``distributed_scenarios.py`` in 2 processes (gloo, CPU;
``compiler="aot_eager"`` except one Inductor case), so torch's import and each compile are
paid once per process; each test below reads its scenario's verdict from every rank.
``pytest -m gpu`` runs them with world size 1 over NCCL and, on a machine with two or more
GPUs, in 2 ranks over NCCL (one GPU a rank).
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
    failed = {rank: r[name]["detail"] for rank, r in results.items() if not r.get(name, {}).get("ok")}
    assert not failed, "\n".join(f"rank {rank}: {detail}" for rank, detail in failed.items())


@pytest.mark.parametrize("name", scenarios.SCENARIOS)
def test_two_ranks_on_cpu(cpu_results, name):
    _verdict(cpu_results, name)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def nccl_results(request, tmp_path_factory):
    """Every scenario over NCCL, one GPU a rank: world size 1 on any CUDA machine, 2 where
    two GPUs exist."""
    world = request.param
    if torch.cuda.device_count() < world or not dist.is_nccl_available():
        pytest.skip(f"needs {world} CUDA device(s) and NCCL")
    return scenarios.launch(world, tmp_path_factory.mktemp(f"dist_nccl{world}"), device="cuda", timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("name", scenarios.SCENARIOS)
def test_over_nccl(nccl_results, name):
    _verdict(nccl_results, name)
