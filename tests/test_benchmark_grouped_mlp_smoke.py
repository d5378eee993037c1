"""CPU smoke test of benchmarks/grouped_mlp.py, the "Hopper speed" issue's benchmark, which
runs once per device call on the H200 and must not fail there on something a CPU can catch:
its main at the tiny shape (compiler="aot_eager") gives every row with finite numbers; the
floor's byte model equals the bytes the Triton lowering's casts, amax passes and
dequantizations read and write; the py-spy output parser; the option checks; and CPU runs
of the other H200 benchmarks whose failure would waste device time (compile_time.py,
cast_sass.py, epilogue_sass.py, cast_tiles.py, model_step.py, inkernel_decode.py)."""

import collections
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import grouped_mlp as gm  # noqa: E402

NUMBERS = ["time/vs", "ms", "TFLOP/s", "saved MiB", "saved/bf16", "host ms", "first s", "first/vs"]


def _cells(row):
    assert len(row) == len(gm.HEADERS), row
    return dict(zip(gm.HEADERS, row))


def _finite(text):
    return math.isfinite(float(text))


def test_main_on_cpu_gives_every_row_with_finite_numbers(capsys):
    rows = gm.main(["--device", "cpu", "--shapes", "tiny", "--compiler", "aot_eager", "--host-profile",
                    "--host-sample"])
    out = capsys.readouterr().out
    assert "graphs-on rows skipped on the CPU" in out
    assert f"] cpu ({os.cpu_count()} cores); torch {torch.__version__}" in out  # what measured it
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("tiny", act, name, "off") for act in ("srelu", "swiglu") for name in (gm.BASELINE, gm.OURS)]
    for row in rows:
        cells = _cells(row)
        assert cells["note"] == "" and cells["vs"] == "bf16 off", cells
        assert all(_finite(cells[c]) for c in NUMBERS), cells
        assert cells["peak GiB"] == "-"  # no allocator statistics on the CPU
        if cells["implementation"] == gm.OURS:
            assert float(cells["floor ms"]) > 0 and _finite(cells["floor/vs"]), cells
        else:
            assert cells["time/vs"] == cells["saved/bf16"] == cells["first/vs"] == "1.00", cells
    assert out.count("floor: bf16 GEMMs") == 2
    assert out.count("function (own time)") == 2  # --host-profile, once per activation
    assert out.count("py-spy not found on PATH") == 1 or out.count("samples at 200 Hz") == 2
    assert out.rstrip().splitlines()[-len(rows) - 2].split() == " ".join(gm.HEADERS).split()  # the table, last


def test_extra_rows_on_cpu(capsys):
    rows = gm.main(["--device", "cpu", "--shapes", "tiny", "--compiler", "aot_eager", "--activations", "srelu",
                    "--graphs", "off", "--extra", "eager", "save-D", "fake-quant", "reuse", "checkpoint",
                    "--peak-alive"])
    assert capsys.readouterr().out.count("--peak-alive: the allocator's history needs CUDA; skipped") == 2
    assert [r[2] for r in rows] == [gm.BASELINE, gm.OURS, gm.EXTRA["eager"], gm.EXTRA["save-D"],
                                    gm.EXTRA["fake-quant"], gm.EXTRA["reuse"], gm.CHECKPOINTED_BASELINE,
                                    gm.EXTRA["checkpoint"]]
    for row in rows:
        cells = _cells(row)
        name = cells["implementation"]
        reused = name == gm.EXTRA["reuse"]
        assert cells["note"] == ("kept copies 0.0 MiB" if reused else ""), cells  # tiny: 4 x 48 x 32 x 1.125 x 2 B
        assert all(_finite(cells[c]) for c in NUMBERS), cells
        assert (cells["floor ms"] != "-") == (name.startswith("nvfp4") and not gm.is_checkpointed(name)), cells
        assert cells["vs"] == ("bf16 ckpt off" if gm.is_checkpointed(name) else "bf16 off"), cells
    checkpointed = {r[2]: _cells(r) for r in rows if gm.is_checkpointed(r[2])}
    assert checkpointed[gm.CHECKPOINTED_BASELINE]["time/vs"] == "1.00"
    # under checkpointing both keep only the step's inputs: the same bytes
    assert checkpointed[gm.EXTRA["checkpoint"]]["saved/bf16"] == "1.00", checkpointed


def test_graphs_need_inductor_and_cpu_skips_them(capsys):
    with pytest.raises(SystemExit):
        gm.parse_args(["--compiler", "aot_eager"])  # cuda, graphs on by default
    assert "--graphs on needs --compiler inductor" in capsys.readouterr().err
    opts = gm.parse_args(["--device", "cpu"])
    assert opts.graphs == [False] and opts.shapes == ["tiny"]
    assert gm.parse_args([]).graphs == [False, True] and gm.parse_args([]).shapes == ["S1", "S2", "S3", "S4"]


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_quant_bytes_equal_the_triton_launches(activation, use_steps, replace_launches):
    """gm.quant_bytes against the fused ops on the Triton steps with every fused kernel (the
    H200's plan), launches recorded instead of run: the bytes of each cast's source and the
    copies it writes (a row-only or column-only cast passes None for the other copy's pointers),
    of each amax pass's source, and of each dequantization's copy and bf16 output."""
    from host_overhead import fused_step
    from nvfp4_inductor.lowerings.triton import STEPS as TRITON

    moved = collections.Counter()

    def record(kernel, grid, **kw):
        name = kernel.__name__
        if name == "_group_amax_kernel":
            moved[name] += kw["x_ptr"].nbytes
        elif name == "_dequantize_kernel":  # both operands of a GEMM
            moved[name] += sum(kw[f"{o}_{t}_ptr"].nbytes for o in "ab" for t in ("data", "scale", "out"))
        elif name == "_group_cast_kernel":
            source = kw["x_ptr"]
            copies = [kw[k] for k in ("row_data_ptr", "row_scale_ptr", "col_data_ptr", "col_scale_ptr")]
            moved[name] += source.nbytes + sum(c.nbytes for c in copies if c is not None)

    replace_launches(lambda launch: record)
    target = use_steps(TRITON, like="triton").name
    g, t, h, f, _ = gm.SHAPES["tiny"]
    f1 = 2 * f if activation == "swiglu" else f
    sizes = torch.tensor([100, 50, 0, 106])
    x, dy = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16)
    w1, w2 = torch.empty(g, f1, h, dtype=torch.bfloat16), torch.empty(g, h, f, dtype=torch.bfloat16)
    fused_step(x, w1, w2, sizes, torch.rand(t), dy, activation, None, True, target)
    assert set(moved) == {"_group_amax_kernel", "_dequantize_kernel", "_group_cast_kernel"}
    assert sum(moved.values()) == gm.quant_bytes(g, t, h, f, f1), dict(moved)


def test_own_samples_reads_py_spy_raw_stacks():
    raw = ("0x7f01 (libc.so.6);main (grouped_mlp.py:12);step (grouped_mlp.py:40) 7\n"
           "0x7f01 (libc.so.6);main (grouped_mlp.py:12);step (grouped_mlp.py:41) 3\n"
           "0x7f01 (libc.so.6);main (grouped_mlp.py:12);0x7f0badc0de (libcuda.so.1) 5\n"
           "\n")
    assert gm.own_samples(raw) == {"step (grouped_mlp.py)": 10, "? (libcuda.so.1)": 5}


def test_host_categories_take_the_first_category_any_frame_matches():
    frame = {
        "hook": "dynamo__custom_eval_frame (libtorch_python.so)",
        "guard": "torch::dynamo::(anonymous namespace)::RootGuardManager::check_nopybind (libtorch_python.so)",
        "aot": "runtime_wrapper (torch/_functorch/_aot_autograd/runtime_wrappers.py:566)",
        "call": "Runner.call (/tmp/torchinductor_root/ab/cabc.py:120)",
        "launch": "CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1300)",
        "cuda": "0x7f0badc0de (libcuda.so.1)",
        "alloc": "empty_strided_cuda (libtorch_python.so)",
        "engine": "_engine_run_backward (torch/autograd/graph.py:829)",
        "step": "step (grouped_mlp.py:40)",
    }
    raw = "\n".join(f"{';'.join(frame[k] for k in keys.split())} {n}" for keys, n in [
        ("step hook guard", 4), ("step hook aot call launch cuda", 7), ("step hook aot call alloc", 2),
        ("step hook aot call", 3), ("step engine", 5), ("step", 1)])
    assert gm.host_categories(raw) == {
        "Dynamo guard checks": 4, "Triton launches (Inductor's CachingAutotuner.run and below)": 7,
        "allocations (empty_strided_cuda)": 2, "Inductor's wrapper code, own lines": 3,
        "autograd engine (incl. waiting on its device thread)": 5, "other": 1}


def test_alive_at_peak_replays_the_allocator_history():
    """The peak is the largest sum of blocks alive at once (here after a free that a
    smaller peak came before); a block is alive until its free completes; a free of a block
    allocated before the recording is ignored."""
    def event(action, addr, size):
        return {"action": action, "addr": addr, "size": size}

    trace = [event("alloc", 1, 100), event("alloc", 2, 50), event("free_requested", 1, 100),
             event("free_completed", 1, 100), event("free_completed", 9, 400), event("alloc", 3, 200),
             event("alloc", 4, 10), event("free_completed", 3, 200), event("alloc", 5, 30)]
    peak, blocks = gm.alive_at_peak({"device_traces": [trace]})
    assert peak == 260 and [b["addr"] for b in blocks] == [3, 2, 4]
    assert gm.alive_at_peak({"device_traces": [[]]}) == (0, [])


def test_allocated_by_names_the_generated_code_line_first(tmp_path, monkeypatch):
    from torch._inductor.runtime import cache_dir_utils

    monkeypatch.setattr(cache_dir_utils, "cache_dir", lambda: str(tmp_path))
    generated = tmp_path / "cabc.py"
    generated.write_text("def call(args):\n    buf3 = empty_strided_cuda((64, 32), (32, 1), torch.bfloat16)\n")
    ours = os.path.join(os.path.dirname(gm.nv.__file__), "ops.py")
    torch_frame = {"filename": torch.__file__, "line": 1}
    frames = [torch_frame, {"filename": str(ours), "line": 1}, {"filename": str(generated), "line": 2}]
    assert gm.allocated_by(frames) == "cabc.py:2 buf3 = empty_strided_cuda((64, 32), (32, 1), torch.bfloat16)"
    assert gm.allocated_by(frames[:2]).startswith("ops.py:1 ")
    assert gm.allocated_by([torch_frame]).startswith("__init__.py:1 ") and gm.allocated_by([]) == "?"


def test_compile_time_benchmark_runs_on_cpu():
    """benchmarks/compile_time.py (first step against depth, each row cold and cached in
    processes of its own): a row per implementation asked for and depth with finite numbers;
    the one-layer rows have no slope. Two of the three implementations: on the CPU the
    reference target is never traced as launches, so the untraced row runs the same code as
    the traced one (and each row is four child processes, most of this test's time)."""
    import compile_time

    only = ["bf16 compiled", "nvfp4, traced launches"]
    rows = compile_time.main(["--device", "cpu", "--shape", "tiny", "--compiler", "aot_eager", "--layers", "2", "1",
                              "--only", *only])
    assert set(only) < set(compile_time.implementations("swiglu", "aot_eager"))
    assert [(r[0], r[1]) for r in rows] == [(name, n) for name in only for n in ("1", "2")]
    for row in rows:
        cells = dict(zip(compile_time.HEADERS, row))
        assert all(_finite(cells[k]) for k in ("first s", "cached s", "warm ms", "host ms"))
        assert (cells["s per layer"] == "-") == (cells["layers"] == "1")
        assert cells["analyses (reused)"] == "0 (0)"  # the CPU's reference target is never traced as launches
    with pytest.raises(SystemExit):
        compile_time.main(["--device", "cpu", "--layers", "0"])


def test_compile_time_phases_list_the_triton_cache_by_time(tmp_path):
    """compile_time.py --phases: every kernel binary and launcher library of a Triton cache
    directory, by the time it was written, relative to the step's start."""
    import compile_time

    for name, kind, written in [("a1", "_cast_kernel.cubin", 30.0), ("b2", "__triton_launcher.so", 20.0),
                                ("c3", "_cast_kernel.json", 10.0)]:
        (tmp_path / name).mkdir()
        f = tmp_path / name / kind
        f.write_text("")
        os.utime(f, (written, written))
    assert compile_time.triton_cache_timeline(str(tmp_path), 5.0) == [
        ["15.0", "launcher", "__triton_launcher.so"], ["25.0", "kernel", "_cast_kernel"]]
    assert compile_time.triton_cache_timeline(str(tmp_path / "absent"), 0.0) == []


def test_compile_time_phases_time_the_progress_lines_from_the_steps_start():
    """compile_time.py --phases: each backend progress line gets its seconds from the step's
    start, read from torch's log stamp (local time of day); other lines are left as they are."""
    import time

    import compile_time

    started = time.mktime((2026, 12, 6, 23, 59, 58, 0, 0, -1)) + 0.25
    line = "I1206 23:59:59.750000 1236 nvfp4_inductor/compiler/backend.py:252] nvfp4: rewrote"
    assert compile_time.log_line_at(line, started) == "   1.5  " + line
    after_midnight = "I1207 00:00:03.250000 1236 early_compile.py:496] nvfp4: 17 compiles started early"
    assert compile_time.log_line_at(after_midnight, started) == "   5.0  " + after_midnight
    assert compile_time.log_line_at("nvfp4: no stamp", started) == "nvfp4: no stamp"


def test_model_step_benchmark_rewrites_every_transformers_layer_on_cpu(capsys):
    """benchmarks/model_step.py (transformers MoE models, unchanged, BF16 against the
    backend): at tiny sizes, both cases give a row per implementation with finite numbers,
    and the backend rewrites the block's grouped MLP and every decoder layer's, with no
    graph break in the model's code."""
    import model_step

    rows = model_step.main(["--device", "cpu", "--tiny", "--compiler", "aot_eager", "--families", "qwen3_moe",
                            "--tokens", "256", "--layers", "2", "--seq", "64", "--reuse-weights", "--host-sample"])
    out = capsys.readouterr().out
    assert out.count("py-spy not found on PATH") == 1 or out.count("host samples of a warm step") == len(rows)
    names = [*model_step.IMPLEMENTATIONS, model_step.REUSE]
    assert [(r[0], r[4], r[5]) for r in rows] == [(case, name, "off") for case in ("block", "model") for name in names]
    for row in rows:
        cells = dict(zip(model_step.HEADERS, row))
        assert cells["graph breaks"] == "0", cells
        # the kept copies: W1 (4 x 64 x 64) and W2 (4 x 64 x 32) of each layer, 1.125 bytes an element
        kept = {"block": "kept copies 0.0 MiB", "model": "kept copies 0.1 MiB"}[cells["case"]]
        assert cells["note"] == (kept if cells["implementation"] == model_step.REUSE else ""), cells
        assert all(_finite(cells[k]) for k in ("ms", "vs bf16", "host ms", "first s", "loss")), cells
        assert cells["peak GiB"] == "-"  # no allocator statistics on the CPU
    assert [dict(zip(model_step.HEADERS, r))["sites"] for r in rows] == ["-", "1/1", "1/1", "-", "2/2", "2/2"]
    assert [r[3] for r in rows] == ["256"] * 3 + ["128"] * 3
    losses = [dict(zip(model_step.HEADERS, r))["loss"] for r in rows]
    assert losses[1] == losses[2] and losses[4] == losses[5]  # reusing the weights' casts changes no bit
    with pytest.raises(SystemExit):  # CUDA graphs need a GPU
        model_step.main(["--device", "cpu", "--graphs", "on"])


def _main_in_child(script: str, argv: list[str], tmp_path) -> list[list[str]]:
    """benchmarks/<script>.py's main(argv) rows, run in a child process without the
    interpreter: the SASS scripts compile for sm_90a and make a stand-in driver Triton's
    active one, which this process must not get."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import json, sys; sys.path.insert(0, 'benchmarks'); import {script}; "
            f"json.dump({script}.main({argv!r}), open({str(tmp_path / 'rows.json')!r}, 'w'))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((tmp_path / "rows.json").read_text())


def test_cast_sass_counts_the_column_block_and_token_loops(tmp_path):
    """benchmarks/cast_sass.py (SM90 instructions per cast element, compiled here with
    Triton's ptxas): one column block per program compiles to straight-line code, four to a
    loop whose body holds most of the kernel, and the loop spreads the per-program work
    over more elements; a row-only cast's tokens in a loop of 4 count through the nested
    loop, and every variant reports its compile time."""
    rows = _main_in_child("cast_sass", ["--variants", "row", "--groups", "8", "--k-blocks", "1", "4",
                                        "--token-unroll", "16", "4"], tmp_path)
    one, one_u4, four, four_u4 = [
        dict(zip(["variant", "groups", "k_blocks", "unroll", "sass", "loop", "per_element", "registers", "spills",
                  "compile_s"], r)) for r in rows]
    assert (one["k_blocks"], one["unroll"], one["loop"]) == ("1", "16", "0")
    assert four["k_blocks"] == "4" and int(four["loop"]) > int(four["sass"]) // 2
    assert float(four["per_element"]) < float(one["per_element"])
    # tokens in a loop of 4: a quarter of the code, run 4 times a block -- about the same
    # instructions an element, counted through the nested loop (not 4x fewer)
    assert int(four_u4["sass"]) < int(four["sass"]) // 2 and int(one_u4["loop"]) > 0
    for rolled, unrolled in ((one_u4, one), (four_u4, four)):
        assert 0.9 < float(rolled["per_element"]) / float(unrolled["per_element"]) < 1.2, (rolled, unrolled)
    assert all(float(r["compile_s"]) > 0 for r in (one, one_u4, four, four_u4))


def test_epilogue_sass_finds_the_split_dact_epilogue_spills_less(tmp_path):
    """benchmarks/epilogue_sass.py (registers and spills of the fused epilogue GEMMs at each
    tile config, compiled here for sm_90a): at 128x256 tiles the dact kernel's epilogue
    spills, and run on the tile's column quarters in turn it spills less (no bytes with
    Triton 3.6 and 3.9)."""
    rows = _main_in_child("epilogue_sass", ["--kernels", "dact", "--activations", "srelu", "--configs",
                                            "128x256x64 w8 s3", "128x256x64 w8 s3 /4"], tmp_path)
    whole, quarters = [dict(zip(["kernel", "act", "config", "sass", "loop", "registers", "spills"], r)) for r in rows]
    assert (whole["config"], quarters["config"]) == ("128x256x64 w8 s3", "128x256x64 w8 s3 /4")
    assert int(whole["spills"]) > 0 and int(quarters["spills"]) < int(whole["spills"]), (whole, quarters)


def test_cast_tiles_dry_run_finds_every_launch_bit_equal():
    """benchmarks/cast_tiles.py (which launches and tiles each cast should use) on the CPU:
    every row-only and column-only launch, at the heuristic's tiles and a candidate, gives
    the bits of the cast writing both copies (one launch for RNE, two for SR); a row-only
    deq() cast at the candidate's tiles gives the heuristic's, and so do a weight stack's
    copies at a candidate's tiles and its row copy alone."""
    import cast_tiles

    rows = cast_tiles.main(["--device", "cpu"])
    bits = [r[5] for r in rows]
    assert "DIFFER" not in bits
    # {RNE, SR} x {row, col} x 2 tiles, RNE's row deq() x 2 tiles, the stack's 2
    assert bits.count("equal") == 2 * 2 * 2 + 2 + 2, rows


def test_cast_tiles_named_candidates():
    """--tiles: the named candidates replace the built-in ones (here a 16-row, 64-column tile,
    a shape TILES lacks, on the column-only SR launch), and a malformed one is refused
    naming the flag."""
    import cast_tiles
    from nvfp4_inductor.kernels.config import CastConfig

    rows = cast_tiles.main(["--device", "cpu", "--cases", "tiny x", "--roundings", "SR", "--kinds", "col",
                            "--tiles", "16x64w1k8"])
    assert [r[3] for r in rows if r[2] == "col"] == ["heuristic", "16x64 w1 k8"], rows
    assert all(r[5] == "equal" for r in rows if r[2] == "col"), rows
    assert cast_tiles.parse_tiles("16x512w2k2u4r168") == CastConfig(16, 512, 2, 168, 2, token_unroll=4)
    with pytest.raises(SystemExit):
        cast_tiles.main(["--device", "cpu", "--tiles", "16x64"])



def test_model_step_benchmark_under_gradient_checkpointing_on_cpu():
    """--checkpoint: transformers' gradient checkpointing on every decoder layer; each layer's
    grouped MLP is rewritten inside its checkpointed region, with no graph break."""
    import model_step

    rows = model_step.main(["--device", "cpu", "--tiny", "--compiler", "aot_eager", "--families", "qwen3_moe",
                            "--cases", "model", "--layers", "2", "--seq", "64", "--checkpoint"])
    cells = [dict(zip(model_step.HEADERS, r)) for r in rows]
    assert [(c["sites"], c["graph breaks"]) for c in cells] == [("-", "0"), ("2/2", "0")], cells


def test_inkernel_decode_gemm_equals_the_gemm_on_deq_values(capsys):
    """benchmarks/inkernel_decode.py under the interpreter: its GEMM decoding the packed
    weight in the K loop gives the bits of the same GEMM on the dequantize kernel's bf16
    copy (the same products in the same order), on every E2M1 code, and both are the
    product torch computes; the copy equals formats.operand_values. Its main says on the
    CPU that it needs a GPU."""
    import inkernel_decode as dec

    m = n = k = 128
    codes, scales = dec.random_weight(n, k, "cpu")
    assert set(torch.cat([codes & 15, codes >> 4]).unique().tolist()) == set(range(16))
    b = dec.dequantize_bf16(codes, scales)
    assert torch.equal(b, dec.expected(codes, scales))
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in range(2)]
    for out, decode in zip(outs, (False, True)):
        dec.gemm(a, b, codes, scales, out, decode, False, (64, 64, 64, 4, 2))
    assert torch.equal(outs[1], outs[0])
    want = a.float() @ b.float().t()
    assert (outs[1].float() - want).abs().max() <= 1e-2 * want.abs().max()
    with pytest.raises(SystemExit):
        dec.main(["--shapes", "128x128x128"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kernel_compile_time_records_and_times_the_casts_on_cpu(tmp_path):
    """benchmarks/kernel_compile_time.py at the tiny shape, its group casts only, each
    compiled to TTIR (in a child without the interpreter, on its stand-in sm_90): every
    variant a row of its own label with its front end and TTIR timed and nothing after;
    the slowest one compiled again with one choice changed."""
    import json

    out = tmp_path / "out.json"
    rows = _main_in_child("kernel_compile_time", ["--shape", "tiny", "--activation", "srelu", "--only",
                                                  "_group_cast_kernel", "--until", "ttir", "--investigate", "1",
                                                  "--json", str(out)], tmp_path)
    import kernel_compile_time as kct

    cells = [dict(zip(kct.HEADERS, row)) for row in rows]
    assert len(cells) >= 4 and {c["kernel"] for c in cells} == {"_group_cast_kernel"}
    assert len({c["variant"] for c in cells}) == len(cells)  # each variant told apart
    for c in cells:
        assert float(c["front s"]) > 0 and float(c["ttir s"]) > 0 and int(c["TTIR lines"]) > 0, c
        assert c["ttgir s"] == c["cubin s"] == c["PTX lines"] == "", c  # --until ttir
    assert [float(c["total s"]) for c in cells] == sorted((float(c["total s"]) for c in cells), reverse=True)
    (investigated,) = json.loads(out.read_text())["investigation"]
    assert investigated["label"] == cells[0]["variant"]
    changed = [r[0] for r in investigated["rows"]]
    assert any(c.startswith("BK=") for c in changed) and any(c.startswith("num_warps=") for c in changed)


def test_kernel_compile_time_alternatives_are_the_launchers_choices():
    """Each alternative changes one choice to another value group_cast's launcher could
    pass: EVEN_K follows BK, SR brings its seed pointer, TOKEN_UNROLL only where it shapes
    the code (row-wise-only 1D casts), SHARED_CODES only off from on."""
    import kernel_compile_time as kct

    bf16 = kct.TensorArg(torch.bfloat16, True)
    row_only = dict(K=768, ROWWISE=True, COLUMNWISE=False, BLOCK_2D=False, RHT=False, SIGN_MASK=0, SR=False,
                    seed_ptr=None, SHARED_CODES=False, ROW_DEQ=True, row_data_ptr=bf16, BM=16, BK=256, EVEN_K=True,
                    K_BLOCKS=2, TOKEN_UNROLL=1)
    alternatives = {label: (args, options) for label, args, options in kct.cast_alternatives(row_only,
                                                                                              {"num_warps": 1})}
    assert {"TOKEN_UNROLL=16", "BK=512", "num_warps=4", "SR=1", "ROW_DEQ=0"} <= set(alternatives)
    assert "BK=256" not in alternatives and "num_warps=1" not in alternatives and "RHT=1" not in alternatives
    assert alternatives["BK=512"][0]["EVEN_K"] is False and alternatives["BK=512"][0]["BK"] == 512
    assert alternatives["SR=1"][0]["seed_ptr"] == kct.TensorArg(torch.int64, True)
    assert alternatives["ROW_DEQ=0"][0]["row_data_ptr"].dtype == torch.uint8
    assert alternatives["num_warps=4"][1] == {"num_warps": 4}
    column_2d = dict(row_only, ROWWISE=True, COLUMNWISE=True, BLOCK_2D=True, SHARED_CODES=True)
    labels = [label for label, _, _ in kct.cast_alternatives(column_2d, {"num_warps": 4})]
    assert "SHARED_CODES=0" in labels and not any(label.startswith(("TOKEN_UNROLL", "SR", "RHT")) for label in labels)
