"""examples/expert_parallel_scaling.py (docs/distributed.md, "Expert-parallel scaling") in 2
processes: gloo, CPU, tiny shapes, compiler aot_eager. The GPU numbers need several GPUs;
this checks that the benchmark runs end to end on both ranks and that its table and JSON
hold what the docs say: a row per implementation, finite positive times, the all-to-alls
inside the step, finite outputs and input gradients on every rank."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

from distributed_scenarios import free_port  # also puts examples/ on sys.path

import expert_parallel_scaling as scaling  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "expert_parallel_scaling.py"


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", OMP_NUM_THREADS="1", **extra)
    env.pop("TRITON_INTERPRET", None)  # the reference target on the CPU, as tests/distributed_scenarios.py
    return env


def launch(out_dir: pathlib.Path, *args: str, world: int = 2, timeout: float = 120.0):
    """The script in `world` processes as torchrun starts them; (exit codes, outputs, rank 0's JSON)."""
    port, procs = free_port(), []
    for rank in range(world):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--compiler", "aot_eager",
                                       "--out", str(out_dir / "run.json"), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + "\n(killed: timeout)")
    codes = [proc.returncode for proc in procs]
    path = out_dir / "run.json"
    return codes, outputs, json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def top1(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ep_scaling"), "--tokens", "64", "--hidden", "64", "--ffn", "64",
                  "--experts", "4", "--steps", "3", "--warmup", "1")


def _finished(run):
    codes, outputs, result = run
    assert codes == [0, 0], "\n".join(f"rank {r} (exit {c}):\n{o[-3000:]}" for r, (c, o) in
                                      enumerate(zip(codes, outputs)))
    assert result is not None
    return outputs, result


def test_both_ranks_finish_and_rank_0_prints_the_table(top1):
    outputs, result = _finished(top1)
    assert result["world"] == 2 and result["backend"] == "gloo" and result["compiler"] == "aot_eager"
    lines = outputs[0].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ranks"))  # CPU processes, not GPUs
    assert "step ms" in lines[header] and "a2a ms" in lines[header] and "experts ms" in lines[header]
    assert "tokens/s/rank" in lines[header] and "GPU" not in lines[header]
    assert [line.split()[:2] for line in lines[header + 2:header + 4]] == [["2", "bf16"], ["2", "nvfp4"]]
    assert "ranks  implementation" not in outputs[1]  # rank 0 only


def test_a_row_per_implementation_with_finite_positive_numbers(top1):
    _, result = _finished(top1)
    assert [row["implementation"] for row in result["rows"]] == ["bf16", "nvfp4"]
    for row in result["rows"]:
        for key in ("step_ms", "tokens_per_s_per_gpu", "a2a_ms", "experts_ms", "first_step_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["implementation"], key, row[key])
        assert row["finite"], f"{row['implementation']}: non-finite output or dX on some rank"
        assert row["tokens_per_rank"] == 64 and row["rows_per_rank_max"] >= 64 // 2  # 2 ranks, top-1
        assert math.isclose(row["tokens_per_s_per_gpu"], 64 / row["step_ms"] * 1e3)
        assert row["peak_mib"] is None  # CUDA memory only; the table shows "-"


def test_the_rest_column_is_the_step_less_its_parts(top1):
    """Only the accounting: the times themselves are noise on a shared CPU (a2a, timed
    apart, can exceed a step there), and timings are for the benchmark, not for tests."""
    _, result = _finished(top1)
    for row in result["rows"]:
        assert math.isclose(row["rest_ms"], row["step_ms"] - row["a2a_ms"] - row["experts_ms"], abs_tol=1e-9)


def test_top2_nvfp4_and_the_merged_table(tmp_path, top1):
    _, result = _finished(top1)
    run = launch(tmp_path, "--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "2", "--top-k", "2",
                 "--steps", "1", "--warmup", "0", "--implementations", "nvfp4")
    _, top2 = _finished(run)
    (row,) = top2["rows"]
    assert row["implementation"] == "nvfp4" and row["finite"] and row["rows_per_rank_max"] >= 32  # 2 x 32 / 2
    first = tmp_path / "top1.json"
    first.write_text(json.dumps(result))
    merged = scaling.merge([first, tmp_path / "run.json"])
    table = [line for line in merged.splitlines() if line.startswith("| 2 |")]
    assert [line.split(" | ")[1] for line in table] == ["bf16", "nvfp4", "nvfp4"]
    assert merged.count("torchrun --nproc-per-node=2") == 2
    assert "| ranks | implementation |" in merged and "tokens/s/rank" in merged and "GPU" not in merged
    assert scaling.headers(["cuda", "cuda"])[0] == "GPUs" and scaling.headers(["cuda", "cpu"])[0] == "ranks"


@pytest.mark.parametrize("args, message", [
    (["--experts", "3"], "--experts (3) must be divisible by the world size (2)"),
    (["--hidden", "40"], "--hidden must be a multiple of 16"),
    (["--experts", "2", "--top-k", "2", "--tokens", "0"], "--tokens must be at least 1"),
])
def test_arguments_are_checked_before_any_process_group(args, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        scaling.parse_args(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
