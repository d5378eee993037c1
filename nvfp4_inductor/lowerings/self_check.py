"""The cudnn target's self-check: each wired wrapper run on the user's own GPU against the
CPU simulator of its contract (``cudnn_sim``) and the reference steps, once per machine and
software stack, before any plan names the target (docs/blackwell.md).

    verdict(frontend, device, stack, base, caps)   the cached Verdict, or run() now and cache it
    cached(kind, stack, check, consequence)        the same for any kind of check (the
                                                   triton_fp4 target's: fp4_self_check.py)
    known(stack, kind) / forget()                  this process's verdicts
    run(frontend, device, stack, base, caps)       every Case below, then one training step
    checked(counter, stack, cases, step)           the same for any self-check's cases
    restricted(caps, verdict)                the target's Capabilities less what failed

Cases (``CASES``), each a step of the cudnn step table (``cudnn.make_steps``) on small
problems with ragged groups, one of them empty, an all-zero expert weight (alpha 0), and
the edge values of docs/numerics.md section 8 (an all-zero block, bf16 subnormals, block
scales that underflow, a block that sets its group's amax, -0.0), the tanh clamp on
(tanh-SReLU) and off (SReLU):

* the plain grouped GEMM and the wgrad: the target's basis; a failure refuses the target;
* each fused fc1 / fc2-dgrad wrapper per activation: a failure turns off that fused step
  only (the plain steps run it), with one warning naming the wrapper and the disagreement.

Where the frontend's releases state two contracts for a wrapper (dSReLU and the Hadamard
fc1: ``cudnn_sim.SEMANTICS``), the check compares the device's output with the simulator in
each and records the one it computes. The step table passes 1.32's operands, so a wrapper
that computes v1.23's contract fails with that named: its fused step runs unfused.

Tolerances (docs/numerics.md section 7, "The self-check"): relative L2 <= 2^-6 per output
against the simulator (the kernels' approximate tanh / sigmoid, the tensor cores' summation
order); <= 2^-4 against the reference steps (the contract differences 1-6, each about one
bf16 rounding), dprob and the amaxes included. Then one training step through the
restricted table: the fused ops (what a compiled graph calls) == the eager chain, bitwise
(``register_training_step_check``: the compiler layer supplies it, since a step needs the
eager ops above this layer); a failure there refuses the target.

The verdict is a JSON file per ``Stack`` (GPU name, compute capability, driver, torch,
frontend, cutlass-dsl, this package's sources, Triton) and kind of check under Inductor's
cache directory (``cache_path``), so the check runs once per machine and stack; a process keeps the
verdicts it has read. ``torch._dynamo.utils.counters["nvfp4"]["cudnn_self_check_runs"]``
counts the checks run.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import pathlib
import re
import time
import warnings
from typing import Callable, Optional

import torch

from ..recipe import QuantizeOptions
from ..tensor import Operand
from . import cudnn as cd
from . import cudnn_sim
from .target import Capabilities

log = logging.getLogger(__name__)

REL_TOL_SIM = 2 ** -6
REL_TOL_REFERENCE = 2 ** -4
TANH_CLAMP = 3.0


@dataclasses.dataclass(frozen=True)
class Stack:
    """What a verdict holds for: the check runs again when any field changes."""

    gpu: str
    capability: tuple[int, int]
    driver: str
    torch: str
    frontend: str
    cutlass_dsl: str
    package: str
    triton: str  # the quantizers' and the triton_fp4 GEMMs' compiler

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:24]

    @staticmethod
    def of(device: torch.device) -> "Stack":
        """The stack of a CUDA device on this machine (read once per device and process: the
        probe asks at every eager call)."""
        return _stack_of(str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _stack_of(device: str) -> Stack:
    return Stack(torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)), _driver(),
                 torch.__version__, _version("nvidia-cudnn-frontend"), _version("nvidia-cutlass-dsl"),
                 package_version(), _version("triton"))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=1)
def _driver() -> str:
    """The NVIDIA driver's version, e.g. '580.95.05': from NVML where torch found pynvml,
    else from ``nvidia-smi``; 'unknown' where neither answers. torch has no call for it (no
    ``_cuda_getDriverVersion`` in the 2.11 and 2.13 builds: the H100 said 'unknown')."""
    import subprocess

    try:
        import pynvml

        pynvml.nvmlInit()
        found = pynvml.nvmlSystemGetDriverVersion()
        return found.decode() if isinstance(found, bytes) else str(found)
    except Exception:  # noqa: BLE001 - no pynvml, or no NVML library: ask nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else "unknown"


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """This package's version and a hash of its sources (a development tree changes code
    without changing its version): '0.1.0 (sources 1a2b3c4d5e6f)', or '0.1.0 (checkout,
    sources ...)' when it runs from a source tree (the version then from its pyproject.toml,
    whether or not that tree is installed)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    sources = f"sources {digest.hexdigest()[:12]}"
    project = root.parent / "pyproject.toml"
    found = re.search(r'^version\s*=\s*"([^"]+)"', project.read_text(), re.M) if project.is_file() else None
    if found:
        return f"{found.group(1)} (checkout, {sources})"
    return f"{_version('nvfp4_inductor')} ({sources})"


@dataclasses.dataclass(frozen=True)
class Case:
    """One check: `step` of the step table through `wrapper` for `activation` (None: the
    plain GEMMs). semantics: the contract the device computed, for a wrapper with several
    (``cudnn_sim.SEMANTICS``); why: the disagreement, empty when it passed."""

    step: str
    wrapper: str
    activation: Optional[str]
    ok: bool
    why: str = ""
    semantics: Optional[str] = None

    def line(self) -> str:
        sem = f", computes {self.semantics}'s contract" if self.semantics else ""
        return "pass" + sem if self.ok else f"fail ({self.why})"


@dataclasses.dataclass(frozen=True)
class Verdict:
    stack: Stack
    date: str  # UTC, ISO 8601, when the check ran
    seconds: float  # what the check cost
    cases: tuple[Case, ...]

    @property
    def refusal(self) -> Optional[str]:
        """Why the target cannot run at all (a basis step or the training step failed)."""
        bad = [c for c in self.cases if not c.ok and c.activation is None]
        return "; ".join(f"{c.wrapper}: {c.why}" for c in bad) or None

    def case(self, wrapper: str, activation: Optional[str]) -> Optional[Case]:
        return next((c for c in self.cases if c.wrapper == wrapper and c.activation == activation), None)

    def says(self, wrapper: str, activation: Optional[str]) -> str:
        """'self-checked on <GPU>, <date>: pass / fail (why)' for a wrapper, as explain shows it."""
        case = self.case(wrapper, activation)
        what = case.line() if case is not None else "not checked"
        return f"self-checked on {self.stack.gpu}, {self.date[:10]}: {what}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Verdict":
        stack = dict(data["stack"], capability=tuple(data["stack"]["capability"]))
        return cls(Stack(**stack), data["date"], data["seconds"], tuple(Case(**c) for c in data["cases"]))


# ---------------------------------------------------------------------------------------
# What the check runs

# (step, wrapper, activation); activation None: the plain GEMMs, the target's basis
CASES = (
    ("fc2 fprop / fc1 dgrad", cd.GEMM, None),
    ("wgrad", cd.WGRAD, None),
    ("fc1 + activation", cd.FC1_SRELU, "srelu"),
    ("fc1 + activation", cd.FC1_SRELU, "tanh_srelu"),
    ("fc1 + activation", cd.FC1_GLU, "swiglu"),
    ("fc1 + activation + amax", cd.FC1_HADAMARD, "srelu"),
    ("fc1 + activation + amax", cd.FC1_HADAMARD, "swiglu"),
    ("fc2 dgrad + activation backward", cd.DGRAD_SRELU, "srelu"),
    ("fc2 dgrad + activation backward", cd.DGRAD_SRELU, "tanh_srelu"),
    ("fc2 dgrad + activation backward", cd.DGRAD_GLU, "swiglu"),
)

GROUP_SIZES = (40, 0, 136, 80)  # ragged, one empty group; H = 64, F = 128 (SwiGLU: 2F)


def edge_tokens(tokens: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Random bf16 rows with docs/numerics.md section 8's edge values: the first group's
    first block all zero, a block of bf16 subnormals, one of values whose block scale
    underflows, one that sets its group's amax, and -0.0 entries."""
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()
    x[0, :16] = 0.0
    x[1, :16] = 1e-39  # bf16 subnormal
    x[2, :16] = 1e-36  # block scale s <= 2^-10
    x[3, :16] = 3e4  # a block far above the rest: it sets its group's amax
    x[4, ::7] = -0.0
    return x


def _reference():
    """The reference step table, imported when a check runs (importing the package imports
    no step table)."""
    from .reference import STEPS

    return STEPS


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _operands(generator, ffn: int):
    sizes = torch.tensor(GROUP_SIZES)
    tokens, hidden = int(sizes.sum()), 64
    xq = _reference().group_quantize(edge_tokens(tokens, hidden, generator), sizes, QuantizeOptions())
    w = torch.randn(len(GROUP_SIZES), ffn, hidden, generator=generator).bfloat16()
    w[2] = 0.0  # an all-zero expert weight: alpha 0
    wq = _reference().quantize_weights(w)
    return xq.rowwise_data, xq.rowwise_scale, xq.rowwise_amax, wq.rowwise_data, wq.rowwise_scale, wq.amax, sizes


def _wgrad_operands(generator):
    sizes = torch.tensor(GROUP_SIZES)
    tokens = int(sizes.sum())
    cols = QuantizeOptions(rowwise=False, columnwise=True)
    a = _reference().group_quantize(edge_tokens(tokens, 128, generator), sizes, cols)
    b = _reference().group_quantize(edge_tokens(tokens, 64, generator), sizes, cols)
    return (a.columnwise_data, a.columnwise_scale, a.columnwise_amax, b.columnwise_data, b.columnwise_scale,
            b.columnwise_amax, a.columnwise_offsets)


def _step_args(flat) -> tuple:
    """The steps' (operand a, operand b, group sizes or offsets) from the seven tensors."""
    return Operand(*flat[:3]), Operand(*flat[3:6]), flat[6]


# D's cast that the fused fc1's amaxes feed: the unsigned Hadamard, as the cuDNN kernel computes it
_D_CAST = QuantizeOptions(rht=True, sign_mask=0)


def _outputs(steps, wrapper, activation, args, probs, c):
    """The step's outputs through `wrapper` (a tuple of tensors; None entries dropped)."""
    args = _step_args(args)
    clamp = TANH_CLAMP if activation == "tanh_srelu" else None
    if wrapper == cd.GEMM:
        out = (steps.grouped_gemm(*args),)
    elif wrapper == cd.WGRAD:
        out = (steps.grouped_gemm_wgrad(*args),)
    elif wrapper in (cd.FC1_SRELU, cd.FC1_GLU, cd.FC1_HADAMARD):
        out = steps.fc1_act_amax(*args, probs, activation, clamp, _D_CAST, want_amax=wrapper == cd.FC1_HADAMARD)
    else:
        out = steps.fc2_dgrad_act(*args, c, probs, activation, clamp, regenerate=False)
    return tuple(t for t in out if t is not None)


def _reference_outputs(wrapper, activation, args, probs, c):
    """What the unfused reference steps give for the same step."""
    base = _reference()
    args = _step_args(args)
    clamp = TANH_CLAMP if activation == "tanh_srelu" else None
    if wrapper == cd.WGRAD:
        return (base.grouped_gemm_wgrad(*args),)
    g = base.grouped_gemm(*args)
    if wrapper == cd.GEMM:
        return (g,)
    if wrapper in (cd.FC1_SRELU, cd.FC1_GLU, cd.FC1_HADAMARD):
        d = base.activation_forward(g, probs, activation, clamp)
        amaxes = base.group_hadamard_amax(d, args[2], _D_CAST) if wrapper == cd.FC1_HADAMARD else ()
        return (g, d, *amaxes)
    dc, dp, _ = base.activation_backward(g, c, probs, activation, clamp, regenerate=False)
    return dc, dp


def _names(wrapper: str) -> tuple[str, ...]:
    if wrapper in (cd.GEMM, cd.WGRAD):
        return ("out",)
    if wrapper in (cd.FC1_SRELU, cd.FC1_GLU, cd.FC1_HADAMARD):
        return ("C", "D", "amax", "post-RHT amax")
    return ("dC", "dprob")


def _disagreement(names, got, want, tol: float, against: str) -> Optional[str]:
    if len(got) != len(want):
        return f"{len(got)} outputs, {against} gives {len(want)}"
    for name, a, b in zip(names, got, want):
        if a.shape != b.shape:
            return f"{name} has shape {tuple(a.shape)}, {against} {tuple(b.shape)}"
        rel = _rel(a, b)
        if not rel <= tol:
            return f"{name} differs from {against} by relative L2 {rel:.2e} > {tol:.2e}"
    return None


def check_case(frontend, device, wrapper: str, activation: Optional[str], seed: int = 0) -> Case:
    """Run one case on `device` through `frontend`'s wrappers and compare it with the
    simulator (each semantics) and the reference steps, on CPU (module docstring)."""
    step = next(s for s, w, a in CASES if (w, a) == (wrapper, activation))
    generator = torch.Generator().manual_seed(seed)
    probs = c = None
    if wrapper == cd.WGRAD:
        cpu = _wgrad_operands(generator)
    else:
        glu = activation == "swiglu"
        cpu = _operands(generator, 256 if glu and wrapper != cd.DGRAD_GLU else 128)
        probs = torch.rand(cpu[0].shape[0], generator=generator)
        c = torch.randn(cpu[0].shape[0], 256 if glu else 128, generator=generator).bfloat16()
    on_device = [None if t is None else t.to(device) for t in (probs, c)]
    names = _names(wrapper)
    try:
        got = _outputs(cd.make_steps(frontend, _reference()), wrapper, activation, tuple(t.to(device) for t in cpu),
                       *on_device)
    except Exception as err:  # noqa: BLE001 - any refusal of the real wrapper is this case's verdict
        return Case(step, wrapper, activation, False, f"{type(err).__name__}: {str(err).splitlines()[0]}")
    candidates = cudnn_sim.SEMANTICS.get(wrapper, ("1.32",))
    found, misses = None, []
    for semantics in candidates:
        sim = cudnn_sim.frontend({wrapper: semantics} if wrapper in cudnn_sim.SEMANTICS else None)
        miss = _disagreement(names, got, _outputs(cd.make_steps(sim, _reference()), wrapper, activation, cpu, probs, c),
                             REL_TOL_SIM, f"the simulator ({semantics})")
        if miss is None:
            found = semantics
            break
        misses.append(miss)
    recorded = found if wrapper in cudnn_sim.SEMANTICS else None
    if found is None:
        return Case(step, wrapper, activation, False, "; ".join(misses))
    if found != candidates[0]:
        return Case(step, wrapper, activation, False,
                    f"computes v{found}'s contract ({cudnn_sim.SEMANTICS_TEXT[wrapper][found]}), not the "
                    f"{candidates[0]} contract its step is wired for", recorded)
    miss = _disagreement(names, got, _reference_outputs(wrapper, activation, cpu, probs, c), REL_TOL_REFERENCE,
                         "the reference steps")
    return Case(step, wrapper, activation, miss is None, miss or "", recorded)


TrainingStepCheck = Callable[[Capabilities, Callable, torch.device], Optional[str]]
_TRAINING_STEP_CHECK: list[TrainingStepCheck] = []


def register_training_step_check(check: TrainingStepCheck) -> None:
    """Set what runs the check's training step: ``check(caps, steps, device)`` -> None when
    the fused ops equal the eager chain bitwise on a target with these capabilities and step
    table, else why (the compiler layer registers it: ``compiler/self_check_step.py``)."""
    _TRAINING_STEP_CHECK[:] = [check]


def training_step_check() -> Optional[TrainingStepCheck]:
    """The registered training-step check (None before the compiler layer is imported)."""
    return _TRAINING_STEP_CHECK[0] if _TRAINING_STEP_CHECK else None


def run(frontend, device: torch.device, stack: Stack, base, caps: Capabilities) -> Verdict:
    """Every case, then the training step over the restricted table (module docstring)."""
    return checked("cudnn_self_check_runs", stack,
                   lambda: tuple(check_case(frontend, device, w, a) for _, w, a in CASES),
                   lambda partial, step_check: step_check(restricted(caps, partial),
                                                          lambda: cd.make_steps(frontend, base), device))


@torch.compiler.disable  # real kernels on real tensors, never a compiled frame of its own
def checked(counter: str, stack: Stack, cases: Callable[[], tuple[Case, ...]],
            step: Callable[[Verdict, TrainingStepCheck], Optional[str]]) -> Verdict:
    """A self-check's verdict (this module's and fp4_self_check.py's): `cases()`, then, where
    they refuse nothing and a training-step check is registered, `step(partial verdict,
    check)` (why the fused ops differ from the eager chain, or None) as one more case;
    dated, timed, counted in ``counters["nvfp4"][counter]``. Outside every dispatch mode: the
    eager chain first asks for its plan while Dynamo propagates fake tensors through its
    graph node (or AOTAutograd traces it), and the check needs real values."""
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        counters["nvfp4"][counter] += 1
        start = time.perf_counter()
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        found = cases()
        partial = Verdict(stack, date, 0.0, found)
        step_check = training_step_check()
        if partial.refusal is None and step_check is not None:
            why = step(partial, step_check)
            found += (Case("training step", "fused ops == eager chain", None, why is None, why or ""),)
        return Verdict(stack, date, round(time.perf_counter() - start, 3), found)


def restricted(caps: Capabilities, verdict: Verdict) -> Capabilities:
    """`caps` (wired) less each fused step whose wrapper failed for an activation."""
    fc1, amax = set(caps.fused_activations), set(caps.fused_amax_activations or caps.fused_activations)
    dgrad = set(caps.fused_activations if caps.fused_dgrad_activations is None else caps.fused_dgrad_activations)
    for case in verdict.cases:
        if case.ok or case.activation is None:
            continue
        if case.wrapper in (cd.FC1_SRELU, cd.FC1_GLU):
            fc1.discard(case.activation)
        elif case.wrapper == cd.FC1_HADAMARD:
            amax.discard(case.activation)
        else:
            dgrad.discard(case.activation)
    return dataclasses.replace(caps, fused_activations=frozenset(fc1), fused_amax_activations=frozenset(amax & fc1),
                               fused_dgrad_activations=frozenset(dgrad))


# ---------------------------------------------------------------------------------------
# The cache (one per kind of check: "cudnn" here, "triton_fp4" in fp4_self_check.py)


def cache_path(stack: Stack, kind: str = "cudnn") -> pathlib.Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / "nvfp4_inductor" / f"{kind}_self_check" / f"{stack.key()}.json"


_VERDICTS: dict[tuple[str, Stack], Verdict] = {}


def verdict(frontend, device: torch.device, stack: Stack, base, caps: Capabilities) -> Verdict:
    """The cudnn verdict for `stack`: this process's, else the cached file's, else ``run``
    now (written to the cache, with one warning per failed case)."""

    def consequence(case: Case) -> str:
        return "its fused step runs unfused" if case.activation else "the cudnn target is off"

    return cached("cudnn", stack, lambda: run(frontend, device, stack, base, caps), consequence)


def cached(kind: str, stack: Stack, check: Callable[[], Verdict], consequence: Callable[[Case], str]) -> Verdict:
    """The `kind` check's verdict for `stack`: this process's, else the cached file's, else
    ``check()`` now, written to the cache, with one warning per failed case (its wrapper or
    kernel, the disagreement, and `consequence(case)`: what runs instead)."""
    if (kind, stack) in _VERDICTS:
        return _VERDICTS[kind, stack]
    path = cache_path(stack, kind)
    try:
        found = Verdict.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found is None or found.stack != stack:
        log.info("nvfp4: self-checking the %s target on %s (once per machine and software stack)", kind, stack.gpu)
        found = check()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(found)}.tmp")
        tmp.write_text(json.dumps(found.to_json(), indent=1))
        tmp.replace(path)  # atomic: a concurrent process reads a whole file or none
        for case in found.cases:
            if not case.ok:
                warnings.warn(f"nvfp4 {kind} self-check on {stack.gpu}: {case.wrapper}"
                              f"{f' ({case.activation})' if case.activation else ''} disagrees: {case.why}; "
                              f"{consequence(case)} (verdict: {path})", stacklevel=3)
    _VERDICTS[kind, stack] = found
    return found


def known(stack: Stack, kind: str = "cudnn") -> Optional[Verdict]:
    """The verdict of the `kind` check this process holds for `stack`, if any."""
    return _VERDICTS.get((kind, stack))


def forget() -> None:
    """Drop this process's verdicts (the cache files stay)."""
    _VERDICTS.clear()
