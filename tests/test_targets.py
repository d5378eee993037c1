"""The target registry and the policy (docs/numerics.md section 6, rules 3-4): described
targets for the rules, and a made-up target registered through the public registry that
a compiled model runs, counted by the target itself and reported by ``explain``."""

import collections
import dataclasses

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import lowerings
from nvfp4_inductor.lowerings import Capabilities, SiteSpec, Target, choose_plan
from nvfp4_inductor.lowerings.reference import STEPS as REFERENCE_STEPS

ALL = frozenset({"srelu", "tanh_srelu", "swiglu"})


def described(name, caps, device_types=("cuda",), min_capability=None):
    """A target known only by its description (its steps are never run)."""
    return Target(name, steps=lambda: REFERENCE_STEPS, probe=lambda device: caps, device_types=device_types,
                  min_capability=min_capability)


# cuDNN frontend's SM100 kernels as documented: fused fc1 with the unsigned-Hadamard amax.
UNSIGNED = described("unsigned", Capabilities(fused_activations=frozenset({"srelu", "swiglu"}), fused_amax=True),
                     min_capability=(10, 0))
SIGNED = described("signed", Capabilities(fused_activations=ALL, fused_amax=True, fused_amax_signed_hadamard=True))
NO_CLAMP = described("noclamp", Capabilities(fused_activations=frozenset({"srelu", "swiglu"}), fused_amax=True,
                                             fused_amax_signed_hadamard=True))


def site(activation="srelu", capability=(10, 0), **facts):
    return SiteSpec(activation, torch.device("cuda"), capability, **facts)


def plan(target, recipe=nv.Recipe(), **site_facts):
    return choose_plan(site(**site_facts), recipe, candidates=[target, lowerings.get_target("reference")])


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_unsigned_hadamard_amax_is_used_only_with_mask_zero(activation):
    p = plan(UNSIGNED, activation=activation)
    assert (p.target, p.fused_fc1, p.fused_amax, p.fused_dgrad) == ("unsigned", True, False, True)
    assert "0xd7e8" in p.reason and "unsigned" in p.reason
    assert plan(UNSIGNED, nv.Recipe(sign_mask=0), activation=activation).fused_amax
    assert plan(UNSIGNED, nv.Recipe(rht=False), activation=activation).fused_amax


def test_signed_amax_fuses_with_any_mask():
    assert plan(SIGNED, nv.Recipe(sign_mask=0x1234), activation="swiglu").fused_amax


def test_tanh_srelu_fuses_only_where_the_fused_kernel_has_the_clamp():
    assert plan(SIGNED, activation="tanh_srelu").fused_fc1
    p = plan(NO_CLAMP, activation="tanh_srelu")
    assert (p.target, p.fused_fc1, p.fused_amax, p.fused_dgrad) == ("noclamp", False, False, False)
    assert "no fused kernel for tanh_srelu" in p.reason and "amax pass" in p.reason
    assert plan(NO_CLAMP, activation="srelu").fused_amax


def test_targets_are_skipped_with_their_reason():
    not_installed = described("vendor", "vendor: the package is not installed")
    p = choose_plan(site(capability=(9, 0)), nv.Recipe(), candidates=[UNSIGNED, not_installed, SIGNED])
    assert p.target == "signed"
    assert "unsigned needs compute capability >= 10.0, the device has 9.0" in p.reason
    assert "not installed" in p.reason
    srelu_only = described("srelu_only", Capabilities(activations=frozenset({"srelu"})))
    wide = described("wide", Capabilities(alignment=64))
    fp16 = described("fp16", Capabilities(dtypes=frozenset({torch.float16})))
    reference = lowerings.get_target("reference")
    p = choose_plan(site("swiglu", hidden=96, ffn=128), nv.Recipe(), candidates=[srelu_only, wide, fp16, reference])
    assert p.target == "reference" and not (p.fused_fc1 or p.fused_amax or p.fused_dgrad)
    for why in ("srelu_only does not run swiglu", "wide needs H % 64 == 0, got H = 96", "fp16 does not take bfloat16"):
        assert why in p.reason


def test_a_target_for_another_device_type_is_passed_over_silently():
    p = choose_plan(SiteSpec("srelu", torch.device("cpu")), nv.Recipe(),
                    candidates=[SIGNED, lowerings.get_target("reference")])
    assert p.target == "reference" and "signed" not in p.reason


def test_no_target_is_an_error_naming_the_site():
    with pytest.raises(RuntimeError, match="no registered target runs a srelu grouped MLP on cuda"):
        choose_plan(site(capability=(9, 0)), nv.Recipe(), candidates=[UNSIGNED])


def test_cpu_sites_run_the_reference():
    p = choose_plan(SiteSpec.on("cpu", "swiglu"), nv.Recipe())
    assert p.target == "reference" and not (p.fused_fc1 or p.fused_amax or p.fused_dgrad)


def test_registry_errors_and_order():
    with pytest.raises(ValueError, match="target must be one of .*'triton'.*'reference'.*got 'nope'"):
        lowerings.get_target("nope")
    with pytest.raises(ValueError, match="already registered"):
        lowerings.register_target(lowerings.get_target("reference"))
    with pytest.raises(ValueError, match="takes a lowerings.Target"):
        lowerings.register_target("triton")
    with lowerings.registered(SIGNED, before="reference"):
        names = [t.name for t in lowerings.targets()]
        assert names.index("triton") < names.index("signed") < names.index("reference")
    assert "signed" not in [t.name for t in lowerings.targets()]


# ---------------------------------------------------------------------------------------
# A made-up CPU target, registered through the public registry, run by compiled models


def counting_target(name, counts, caps, **step_options):
    """A CPU target whose steps are the reference's, counted per step, with a fused fc1
    kernel (the reference GEMM, activation and, when asked, the amax pass, in one call) and a
    fused fc2-dgrad kernel built the same way. `step_options`: other ``Steps`` fields."""
    ref = dataclasses.replace(REFERENCE_STEPS, **step_options)

    def counted(step, fn):
        def run(*args, **kwargs):
            counts[step] += 1
            return fn(*args, **kwargs)
        return run

    def fc1_act_amax(a, b, group_sizes, probs, activation, clamp, d_cast, *, want_amax=True):
        counts["fc1_act_amax with amax" if want_amax else "fc1_act_amax without amax"] += 1
        c = ref.grouped_gemm(a, b, group_sizes)
        d = ref.activation_forward(c, probs, activation, clamp)
        pre, post = ref.group_hadamard_amax(d, group_sizes, d_cast) if want_amax else (None, None)
        return c, d, pre, post

    def fc2_dgrad_act(a, b, group_sizes, c, probs, activation, clamp, *, regenerate=False):
        counts["fc2_dgrad_act"] += 1
        counts["D regenerated"] += regenerate
        return ref.activation_backward(ref.grouped_gemm(a, b, group_sizes), c, probs, activation, clamp,
                                       regenerate=regenerate)

    steps = dataclasses.replace(
        ref, **{f.name: counted(f.name, getattr(ref, f.name)) for f in dataclasses.fields(ref)
                if callable(getattr(ref, f.name))},
        fc1_act_amax=fc1_act_amax, fc2_dgrad_act=fc2_dgrad_act)
    return Target(name, steps=lambda: steps, probe=lambda device: caps, device_types=("cpu",))


# Fused kernels for every activation; its fused post-RHT amax ignores the sign mask.
MASKLESS = Capabilities(fused_activations=ALL, fused_amax=True, fused_amax_signed_hadamard=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: sizes that other tests of this process compiled
    would otherwise be traced as dynamic, and dynamic weight sizes are not rewritten."""
    torch._dynamo.reset()


def _model(activation="swiglu", recipe=None):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 32, 48, activation, recipe=recipe)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    return mlp, (x, torch.tensor([10, 0, 31, 23]), torch.rand(64, requires_grad=True))


@pytest.mark.parametrize("sign_mask", [0xD7E8, 0], ids=["te_mask", "mask0"])
def test_made_up_target_is_planned_run_and_explained(sign_mask):
    recipe = nv.Recipe(sign_mask=sign_mask)
    counts = collections.Counter()
    with lowerings.registered(counting_target("counting", counts, MASKLESS)):
        mlp, args = _model(recipe=recipe)
        report = nv.explain(mlp, backend=nv.backend(recipe=recipe))(*args)
        [s] = report.sites
        assert s.target == "counting" and "counting" in str(report)
        fused_amax = sign_mask == 0
        if fused_amax:
            assert "counting fuses D's amax into the fc1 epilogue" in s.reason
        else:
            assert "unsigned Hadamard" in s.reason and "amax pass" in s.reason
        forward = dict(s.forward_steps)
        assert ("amax pass over D (pre + post RHT)" in forward) is not fused_amax
        assert all(runs.startswith("test_targets.") for _, runs in s.forward_steps + s.backward_steps)

        compare = nv.compare(mlp, backend=nv.backend(recipe=recipe, compiler="aot_eager"))(*args)
        assert compare.bitwise, str(compare)

        counts.clear()
        compiled = torch.compile(mlp, backend=nv.backend(recipe=recipe, compiler="aot_eager"))
        compiled(*args).sum().backward()
    assert counts["fc1_act_amax with amax" if fused_amax else "fc1_act_amax without amax"] == 1
    assert counts["fc1_act_amax with amax" if not fused_amax else "fc1_act_amax without amax"] == 0
    assert counts["group_hadamard_amax"] == (0 if fused_amax else 1)
    assert counts["fc2_dgrad_act"] == 1 and counts["D regenerated"] == 0
    assert counts["activation_forward"] == 1  # D rebuilt after the dgrad (the reference's d_after_dgrad)
    assert counts["activation_backward"] == 0
    assert counts["grouped_gemm"] == 2 and counts["grouped_gemm_wgrad"] == 2  # fc2 fwd, fc1 dgrad; both wgrads
    assert "counting" not in [t.name for t in lowerings.targets()]


@pytest.mark.parametrize("d_after_dgrad", [True, False], ids=["after_dgrad", "in_dgrad"])
def test_recompute_rebuilds_d_where_the_steps_say(d_after_dgrad):
    """With recompute, the compiled backward rebuilds D either in the fused dgrad's epilogue
    (``regenerate``) or with the activation step after it (``Steps.d_after_dgrad``, so D and
    the dgrad's operand copies are not alive together); explain says which, and the bits
    are the eager chain's either way."""
    counts = collections.Counter()
    with lowerings.registered(counting_target("counting", counts, MASKLESS, d_after_dgrad=d_after_dgrad)):
        mlp, args = _model("srelu")
        [s] = nv.explain(mlp, backend=nv.backend(recompute=True))(*args).sites
        backward = [text for text, _ in s.backward_steps]
        assert ("activation(C) * p -> D, rebuilt after the dgrad" in backward) is d_after_dgrad
        assert any(t.startswith("fc2 dgrad + activation backward") and t.endswith("D regenerated")
                   for t in backward) is not d_after_dgrad
        compare = nv.compare(mlp, backend=nv.backend(recompute=True, compiler="aot_eager"))(*args)
        assert compare.bitwise, str(compare)
        counts.clear()
        compiled = torch.compile(mlp, backend=nv.backend(recompute=True, compiler="aot_eager"))
        compiled(*args).sum().backward()
    assert counts["D regenerated"] == (0 if d_after_dgrad else 1)
    assert counts["activation_forward"] == (1 if d_after_dgrad else 0)


def test_recompute_makes_d_inside_its_cast_where_the_target_can():
    """``Steps.activation_quantize`` (the Triton target's, which makes SReLU's D inside its
    column-wise cast): the recompute's D and its cast are that one step, not the activation
    step and a cast; explain names it, and the bits are the eager chain's."""
    counts = collections.Counter()

    def activation_quantize(c, probs, activation, clamp, group_sizes, cast):
        d = REFERENCE_STEPS.activation_forward(c, probs, activation, clamp)
        return REFERENCE_STEPS.group_quantize(d, group_sizes, cast)

    with lowerings.registered(counting_target("counting", counts, MASKLESS, activation_quantize=activation_quantize)):
        mlp, args = _model("srelu")
        [s] = nv.explain(mlp, backend=nv.backend(recompute=True))(*args).sites
        backward = [text for text, _ in s.backward_steps]
        assert any("D inside the cast" in t for t in backward)
        assert "activation(C) * p -> D, rebuilt after the dgrad" not in backward
        compare = nv.compare(mlp, backend=nv.backend(recompute=True, compiler="aot_eager"))(*args)
        assert compare.bitwise, str(compare)
        counts.clear()
        compiled = torch.compile(mlp, backend=nv.backend(recompute=True, compiler="aot_eager"))
        compiled(*args).sum().backward()
    assert counts["activation_quantize"] == 1 and counts["activation_forward"] == 0


@pytest.mark.parametrize("sign_mask", [0xD7E8, 0], ids=["te_mask", "mask0"])
def test_the_eager_chain_runs_the_plans_fused_steps(sign_mask):
    """Eager means the plan: the chain calls the fused steps where the plan fuses them (with
    the epilogue's amaxes where it takes them), and never the steps they replace."""
    recipe = nv.Recipe(sign_mask=sign_mask)
    counts = collections.Counter()
    with lowerings.registered(counting_target("counting", counts, MASKLESS)):
        mlp, args = _model(recipe=recipe)
        mlp(*args).sum().backward()
    fused_amax = sign_mask == 0
    assert counts["fc1_act_amax with amax" if fused_amax else "fc1_act_amax without amax"] == 1
    assert counts["fc2_dgrad_act"] == 1 and counts["D regenerated"] == 0
    assert counts["activation_forward"] == counts["activation_backward"] == counts["group_hadamard_amax"] == 0
    assert counts["grouped_gemm"] == 2 and counts["grouped_gemm_wgrad"] == 2


def test_a_fused_fc1_not_reading_the_stored_c_keeps_d():
    """Rule 5: where the fused fc1 does not make D from the bf16 C it stores, the backward
    cannot rebuild D, so D's column-wise copy is saved whatever the recompute option; the
    plan says so, explain lists the copy, and the fused dgrad is never asked for D."""
    fp32_epilogue = dataclasses.replace(MASKLESS, fused_d_from_stored_c=False)
    p = plan(described("fp32_epilogue", fp32_epilogue))
    assert p.fused_fc1 and not p.d_regenerable and not p.recomputes_d(True)
    assert "D's column-wise copy is saved, recompute or not" in p.reason
    assert plan(SIGNED).recomputes_d(True) and not plan(SIGNED).recomputes_d(False)
    assert plan(described("unfused", dataclasses.replace(fp32_epilogue, fused_activations=frozenset()))).d_regenerable
    counts = collections.Counter()
    with lowerings.registered(counting_target("counting", counts, fp32_epilogue)):
        mlp, args = _model()
        [s] = nv.explain(mlp, backend=nv.backend(recompute=True))(*args).sites
        assert "D col data" in [name for name, *_ in s.saved]
        assert "quantize D: row + col RHT (row as deq() values)" in dict(s.forward_steps)
        assert "quantize dY: row + col RHT, SR (row as deq() values)" in dict(s.backward_steps)
        compare = nv.compare(mlp, backend=nv.backend(recompute=True, compiler="aot_eager"))(*args)
        assert compare.bitwise, str(compare)
    assert counts["fc2_dgrad_act"] == 2 and counts["D regenerated"] == 0  # compare: eager, compiled


def test_made_up_target_refused_for_an_activation_it_does_not_run():
    counts = collections.Counter()
    srelu_only = dataclasses.replace(MASKLESS, activations=frozenset({"srelu"}))
    with lowerings.registered(counting_target("counting", counts, srelu_only)):
        mlp, args = _model("swiglu")
        [s] = nv.explain(mlp)(*args).sites
        assert s.target == "reference" and "counting does not run swiglu" in s.reason
        torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))(*args).sum().backward()
        assert sum(counts.values()) == 0
        mlp, args = _model("srelu")
        [s] = nv.explain(mlp)(*args).sites
        assert s.target == "counting"


# ---------------------------------------------------------------------------------------
# docs/architecture.md, "Adding a target", step by step


def test_a_target_added_as_the_architecture_doc_says():
    """A vendor target whose vendor API is the CPU simulator of the cuDNN frontend
    (``nvfp4_inductor.testing.cudnn_sim``), added from outside the package by the four
    documented steps: the policy plans it, its table is built when it first runs, explain
    names it, and compiled == eager bitwise."""
    from nvfp4_inductor import numerics
    from nvfp4_inductor.lowerings import cudnn
    from nvfp4_inductor.testing import cudnn_sim

    # 1. Its step table: the vendor's GEMMs and fused kernels, the reference's quantizers;
    #    its GEMM compared with numerics.py.
    sizes = torch.tensor([10, 0, 30])
    xq = numerics.group_quantize_torch(torch.randn(40, 64, dtype=torch.bfloat16), sizes)
    wq = numerics.quantize_weights_torch(torch.randn(3, 128, 64, dtype=torch.bfloat16))
    gemm = (xq.rowwise(), wq.rowwise(), sizes)
    assert torch.equal(cudnn.make_steps(cudnn_sim, REFERENCE_STEPS).grouped_gemm(*gemm),
                       numerics.grouped_gemm_torch(*gemm))

    # 2. Its probe: what the installed API can do, read from its wrappers' signatures; its
    #    fused fc1 reads the fp32 accumulator, so it says fused_d_from_stored_c=False.
    def probe(device):
        return cudnn.wired(cudnn.capabilities_from_signatures(cudnn.read_signatures(cudnn_sim)))

    caps = probe(torch.device("cpu"))
    assert caps.fused_activations == ALL and not caps.fused_d_from_stored_c

    # 3. Declare it: steps() builds the table when the target first runs.
    built = []

    def steps():
        if not built:
            built.append(cudnn.make_steps(cudnn_sim, REFERENCE_STEPS))
        return built[0]

    target = Target("vendor", steps=steps, probe=probe, device_types=("cpu",), describe=cudnn.describe)

    # 4. Register it.
    with lowerings.registered(target, before="reference"):
        p = choose_plan(SiteSpec.on("cpu", "swiglu"), nv.Recipe())
        assert (p.target, p.fused_fc1, p.fused_dgrad) == ("vendor", True, True) and not built
        torch.manual_seed(0)
        mlp = nv.GroupedMLP(3, 64, 128, "swiglu")
        args = (torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True), sizes,
                torch.rand(40, requires_grad=True))
        report = nv.explain(mlp)(*args)
        assert report.sites, str(report)
        [s] = report.sites
        assert s.target == "vendor" and cudnn.FC1_GLU in s.reason
        compare = nv.compare(mlp, backend=nv.backend(compiler="aot_eager"))(*args)
        assert compare.bitwise, str(compare)
    assert len(built) == 1 and "vendor" not in [t.name for t in lowerings.targets()]


def test_importing_the_package_imports_no_step_table_and_no_vendor_package():
    """The built-in targets' step tables (and the vendor package the cudnn one calls) are
    imported when a target first runs (its ``steps``), not with the package; nor is
    ``nvfp4_inductor.testing``."""
    import os
    import pathlib
    import subprocess
    import sys

    lazy = ["nvfp4_inductor.lowerings.reference", "nvfp4_inductor.lowerings.triton", "cudnn", "nvfp4_inductor.testing"]
    root = str(pathlib.Path(nv.__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))

    def imported_after(statement):
        code = f"import sys, nvfp4_inductor; {statement}; print([m for m in {lazy!r} if m in sys.modules])"
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return run.stdout.strip()

    assert imported_after("pass") == "[]"
    assert imported_after("nvfp4_inductor.lowerings.get_target('reference').steps()") == (
        "['nvfp4_inductor.lowerings.reference']")
