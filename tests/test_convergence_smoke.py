"""CPU smoke test of benchmarks/convergence.py: a few steps of a tiny config of
the MoE language model with the nvfp4 backend (compiler="aot_eager"): every MoE layer is
rewritten, the loss is finite and goes down, and recompute on == off bit for bit (losses
and parameters after the steps); --from-json keeps runs of different seeds apart. The real
convergence run is on the GPU (docs/performance.md, "Convergence on real text")."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import convergence as cv  # noqa: E402

CFG = cv.Config(layers=2, hidden=64, heads=2, experts=4, top_k=2, ffn=64, seq=64)
TC = cv.TrainConfig(steps=6, batch=4, lr=3e-3, warmup=1, eval_every=6, eval_batches=1, compiler="aot_eager")


@pytest.fixture(scope="module")
def corpus():
    return cv.load_corpus(max_files=40)


def test_every_moe_layer_is_rewritten():
    report = cv.explain_sites(CFG, "cpu")
    assert len(report.sites) == CFG.layers, str(report)
    assert not report.rejected and not report.graph_breaks, str(report)
    assert all(s.activation == "swiglu" for s in report.sites)


def test_corpus_split_is_by_file_and_deterministic(corpus):
    train, val, info = corpus
    assert info["files"] == 40 and len(train) == info["train_bytes"] > len(val) == info["val_bytes"] > 0
    train2, val2, _ = cv.load_corpus(max_files=40)
    assert train.equal(train2) and val.equal(val2)


def test_nvfp4_learns_and_recompute_is_bitwise(corpus):
    train, val, _ = corpus
    res_on, model_on = cv.train_run("nvfp4", CFG, TC, train, val, progress=False)
    res_off, model_off = cv.train_run("nvfp4_save_d", CFG, TC, train, val, progress=False)
    losses = res_on["train"]
    assert len(losses) == TC.steps and all(math.isfinite(v) for v in losses)
    assert math.isfinite(res_on["final_val"])
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first - 0.1, f"loss did not go down: first two {losses[:2]}, last two {losses[-2:]}"
    assert cv.bitwise_equal(res_on, model_on, res_off, model_off), (res_on["train"], res_off["train"])


def _doc(seed, finals):
    """A result JSON as convergence.py writes it (results without "seed": the older format)."""
    meta = {"model": vars(CFG), "train": {"steps": 2, "batch": 4, "seed": seed}, "device": "cpu"}
    results = [{"run": run, "label": cv.RUNS[run][0], "train": [2.0, v], "val": [[2, v]],
                "tokens_per_s": 1.0, "final_train": v, "final_val": v} for run, v in finals.items()]
    return {"meta": meta, "results": results}


def test_merge_keeps_seeds_apart(tmp_path, capsys):
    import json
    paths = []
    for seed, finals in ((0, {"bf16": 1.0, "nvfp4": 1.01}), (1, {"bf16": 1.1, "nvfp4": 1.089})):
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(_doc(seed, finals)))
    out = tmp_path / "merged"
    results = cv.main(["--from-json", *map(str, paths), "--out", str(out), "--device", "cpu"])
    assert [(r["run"], r["seed"]) for r in results] == [("bf16", 0), ("nvfp4", 0), ("bf16", 1), ("nvfp4", 1)]
    text = capsys.readouterr().out
    # each gap is against the bf16 run of its own seed
    assert "bf16 s1" in text and "+1.00%" in text and "-1.00%" in text, text
    merged = json.loads(out.with_suffix(".json").read_text())
    assert merged["meta"]["seeds"] == [0, 1] and len(merged["results"]) == 4
    # one seed: plain run names, as before
    cv.main(["--from-json", str(paths[0]), "--out", str(tmp_path / "one"), "--device", "cpu"])
    text = capsys.readouterr().out
    assert "bf16 s0" not in text and "+1.00%" in text, text


def test_summary_says_whether_the_runs_separate():
    """Mean and spread per run over seeds; a gap inside BF16's own seed spread does not separate."""
    def results(finals):
        return [{"run": run, "seed": seed, "final_val": v} for seed, row in enumerate(finals)
                for run, v in row.items()]

    close = results([{"bf16": 1.00, "nvfp4": 1.01}, {"bf16": 1.05, "nvfp4": 1.04}])
    text, verdict = cv.summary(close)
    assert "1.0250" in text and "0.0500" in text and "do not separate" in verdict, (text, verdict)
    apart = results([{"bf16": 1.00, "last_bf16": 1.02, "nvfp4": 1.05}, {"bf16": 1.01, "last_bf16": 1.03, "nvfp4": 1.06}])
    _, verdict = cv.summary(apart)
    assert "0.0100" in verdict and verdict.endswith("(every mean gap is larger)"), verdict
    assert cv.summary(results([{"bf16": 1.0, "nvfp4": 1.1}])) == (None, None)


def test_the_last_bf16_run_keeps_the_last_moe_layer():
    model = cv.build_model(CFG, 0, "cpu")
    records = []
    from nvfp4_inductor.compiler import backend as backend_mod
    original = backend_mod.rewrite_graph

    def spy(gm, options, site_call=None):
        records.append(original(gm, options, site_call))
        return records[-1]

    backend_mod.rewrite_graph = spy
    try:
        idx = torch.randint(0, CFG.vocab, (2, CFG.seq))
        cv.compile_model(model, "last_bf16", "aot_eager")(idx, idx)
    finally:
        backend_mod.rewrite_graph = original
    assert [len(r.sites) for r in records] == [CFG.layers - 1]
    assert [d.rule for r in records for _, d in r.kept] == ["last_moe_layers_bf16=1"]
