"""``python -m nvfp4_inductor.check`` (nvfp4_inductor/check.py) on this machine (CPU): it runs
the self-check over the simulator, says what it skipped and why, writes its JSON, exits 0."""

import json
import os
import subprocess
import sys

import torch

from nvfp4_inductor import lowerings
from nvfp4_inductor.check import unregistered


def test_check_command_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nvfp4_inductor.check", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    assert "[PASS] cudnn over the simulator (CPU): training step: fused ops == eager chain" in out.stdout
    assert "[skipped] cudnn: self-check and compiled step on the GPU: no CUDA device" in out.stdout
    assert "[skipped] triton_fp4: self-check and compiled step on the GPU: no CUDA device" in out.stdout
    assert "(checkout, sources " in out.stdout.splitlines()[0]
    assert "timing at S1, S2 vs BF16" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert {r["verdict"] for r in report["checks"]} == {"PASS", "skipped", "info"}
    assert report["environment"]["torch"] == torch.__version__


def test_the_triton_comparison_runs_without_the_sm100_targets():
    before = [t.name for t in lowerings.targets()]
    with unregistered("cudnn", "triton_fp4"):
        assert [t.name for t in lowerings.targets()] == ["triton", "reference"]
    with unregistered():
        assert [t.name for t in lowerings.targets()] == before
    assert [t.name for t in lowerings.targets()] == before


def test_only_targets_whose_gpu_checks_all_passed_are_timed(tmp_path, monkeypatch):
    """On a GPU, the timing table takes the triton target and each SM10x target whose
    self-check and compiled step raised no FAIL row; a target with a failed check is left
    out of it, and the command exits 1."""
    from nvfp4_inductor import check

    class Triton:  # the triton target on a GPU it runs on
        def device_mismatch(self, device_type, capability):
            return None

        def probe(self, device):
            return object()

    def fp4(report, device):
        report.add("fc2 fprop", "triton_fp4 on a test GPU", False, "differs")

    def cudnn(report, device):
        report.add("fc2 fprop", "cudnn on a test GPU", True, "pass")

    timed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    monkeypatch.setattr(check, "environment", lambda: {})
    monkeypatch.setattr(check, "simulated", lambda report: None)
    monkeypatch.setattr(check, "get_target", lambda name: Triton())
    monkeypatch.setattr(check, "compiled_step", lambda *args: None)
    monkeypatch.setattr(check, "fp4_on_blackwell", fp4)
    monkeypatch.setattr(check, "on_blackwell", cudnn)
    monkeypatch.setattr(check, "time_shapes", lambda report, device, shapes, runs: timed.append(runs))
    assert check.main(["--json", str(tmp_path / "r.json")]) == 1
    assert timed == [["triton", "cudnn"]]
