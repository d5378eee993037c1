"""Activations: the registry and the reference math (docs/numerics.md section 5). One of three
activation modules: this one says what each activation is; ``compiler/match_activation.py``
finds the registered activations in Dynamo graphs; ``kernels/activation.py`` runs them in
Triton.

Adding an activation is one ``register_activation(Activation(...))`` (its name, shape,
reference math, FX pattern, whether it is 0 at 0, and Triton code, below); a Triton code
names one of the kernels' branches (``TRITON_BRANCHES``), so an activation the kernels do
not compute yet first needs its branch there. Everything that checks, matches, sizes or
runs an activation reads the registry.

The reference math runs in fp32, and its operation order is the contract: every kernel
epilogue reproduces it operation for operation. Inputs are GEMM outputs already rounded to
bf16 (C, and G = the fc2 dgrad), so a fused kernel, the unfused chain and the backward
recompute all start from the same bits.

    D  = bf16(f(float(C)) * p)                  p = router prob (fp32) or 1
    dC = bf16((float(G) * p) * f'(float(C)))    (gated: per half, below)
    dp = sum_n float(G) * f(float(C))           (order: ``row_sum``)

SReLU:       r = relu(c);            f = r * r;  f' = 2 * r
tanh-SReLU:  t = tanh(relu(c) / s);  b = s * t;  f = b * b;  f' = (2 * b) * (1 - t * t)
SwiGLU:      c = [a | u] (gate a = first half of the columns, up u = second half)
             sg = sigmoid(a); si = a * sg;  f = si * u
             df/da = u * (sg * (1 + a * (1 - sg)));  df/du = si
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch

from .constants import BLOCK

# ----------------------------------------------------------------------------- patterns

# The ops a pattern may use, with their arities; compiler/match_activation.py knows every
# spelling of each (tests/test_activation_registry.py checks it covers this list).
PATTERN_OPS = {"relu": 1, "silu": 1, "tanh": 1, "square": 1, "mul": 2, "div": 2}


@dataclasses.dataclass(frozen=True)
class Var:
    """A leaf of a pattern: ``H`` the fc1 output, ``GATE`` / ``UP`` the gate and up inputs
    of a gated activation, ``S`` the scale (a python float)."""

    name: str

    def __post_init__(self):
        if self.name not in ("H", "GATE", "UP", "S"):
            raise ValueError(f"Var.name must be one of 'H', 'GATE', 'UP', 'S'; got {self.name!r}")

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Op:
    """A node of a pattern: the elementwise op ``name`` (a key of PATTERN_OPS) on ``args``
    (Ops or Vars)."""

    name: str
    args: tuple

    def __post_init__(self):
        if PATTERN_OPS.get(self.name) != len(self.args):
            raise ValueError(f"Op must be one of {PATTERN_OPS} (name: arity); got {self.name!r} with "
                             f"{len(self.args)} argument(s)")
        for a in self.args:
            if not isinstance(a, (Op, Var)):
                raise ValueError(f"Op {self.name!r}: arguments must be Op or Var; got {a!r}")

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(map(repr, self.args))})"

    def leaves(self) -> set[str]:
        return {n for a in self.args for n in (a.leaves() if isinstance(a, Op) else {a.name})}


Pattern = Union[Op, Var]
H, GATE, UP, S = Var("H"), Var("GATE"), Var("UP"), Var("S")


def op(name: str, *args: Pattern) -> Op:
    """``op("square", op("relu", H))``: a pattern node."""
    return Op(name, args)


# ----------------------------------------------------------------------------- Triton branches


@dataclasses.dataclass(frozen=True)
class TritonBranch:
    """One activation the Triton kernels compute: ``code`` is the ACT constexpr its branch
    runs on, ``pattern`` the function that branch computes (operation for operation as the
    reference forward of the entry with that pattern)."""

    code: int
    pattern: Op


# Every activation branch of the Triton kernels (kernels/activation.py, the fused fc1 and
# fc2-dgrad epilogues), by the name of its constant there. The kernels read their codes from
# here and branch on each explicitly (any other code fails their static assertion), and an
# entry's triton_code must be one of these codes with that code's pattern: a code promises
# what the kernel computes. Here, below the kernels, because the registry checks it.
TRITON_BRANCHES = {
    "srelu": TritonBranch(0, op("square", op("relu", H))),
    "tanh_srelu": TritonBranch(1, op("square", op("mul", S, op("tanh", op("div", op("relu", H), S))))),
    "swiglu": TritonBranch(2, op("mul", op("silu", GATE), UP)),
}


def triton_branch(code: int) -> tuple[str, TritonBranch] | None:
    """``(name, branch)`` of the kernels' branch on ``code``, None if they have none."""
    return next(((n, b) for n, b in TRITON_BRANCHES.items() if b.code == code), None)


# ----------------------------------------------------------------------------- the registry


@dataclasses.dataclass(frozen=True)
class Activation:
    """One activation of the grouped MLP: everything the package needs to know about it.

    name: what callers pass as ``activation=`` (and what explain shows).
    gated: fc1 gives 2F columns [gate | up] (F1 = 2F; the fc1 weight's rows 0..F-1 are the
        gate); else F1 = F.
    takes_scale: the activation has one float parameter, passed everywhere as
        ``tanh_clamp_scale``, which must be > 0; without it that argument must be None.
    forward(c, scale) -> f: f(C), (T, F1) -> (T, F), in c's dtype (fp32; fp64 for
        gradcheck), in the contract's operation order; scale is None without takes_scale.
    backward(gp, c, scale) -> (dc, f): from gp = G * p (T, F) and c (T, F1) in the compute
        dtype, dC = gp * f'(c) (T, F1) unrounded and f(c) bit for bit as ``forward`` makes it
        (dp and the regenerated D are made from it).
    pattern: the function as an expression over PATTERN_OPS with leaves H (not gated) or
        GATE and UP (gated), and S (exactly when takes_scale): what
        compiler/match_activation.py looks for in FX graphs, in every spelling it knows.
    zero_at_zero: f is 0 on a row of zeros (+0 or -0): f(0) == 0, and for a gated
        activation f is 0 where the gate row or the up row alone is 0 (a row mask may zero
        one of two separate fc1 GEMMs). Only then does a row mask on fc1's output fold into
        the router prob (compiler/match_activation.py); ``register_activation`` checks it
        against ``forward`` (exactly at 0; a gated one's other half on probe values).
    triton_code: the ACT constexpr of the Triton kernels' branch that computes this
        activation, one of ``TRITON_BRANCHES`` with the same pattern; None: there is no
        Triton kernel, and the Triton target's unfused activation steps run ``forward`` /
        ``backward``.
    """

    name: str
    gated: bool
    takes_scale: bool
    forward: Callable[[torch.Tensor, Optional[float]], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor, Optional[float]], tuple[torch.Tensor, torch.Tensor]]
    pattern: Op
    zero_at_zero: bool
    triton_code: Optional[int] = None

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name.isidentifier()):
            raise ValueError(f"Activation.name must be a python identifier; got {self.name!r}")
        if not isinstance(self.pattern, Op):
            raise ValueError(f"Activation.pattern must be an Op; got {self.pattern!r}")
        want = ({"GATE", "UP"} if self.gated else {"H"}) | ({"S"} if self.takes_scale else set())
        if self.pattern.leaves() != want:
            raise ValueError(
                f"Activation.pattern of {self.name!r} (gated={self.gated}, takes_scale={self.takes_scale}) "
                f"must use exactly {sorted(want)}; got {self.pattern!r}")
        if not isinstance(self.zero_at_zero, bool):
            raise ValueError(f"Activation.zero_at_zero of {self.name!r} must be a bool; got {self.zero_at_zero!r}")
        if self.triton_code is not None:
            self._check_triton_code()

    def _check_triton_code(self) -> None:
        """The kernels branch on triton_code: it must be one of theirs, for this function."""
        is_int = isinstance(self.triton_code, int) and not isinstance(self.triton_code, bool)
        found = triton_branch(self.triton_code) if is_int else None
        if found is None:
            codes = ", ".join(f"{b.code} ({n})" for n, b in TRITON_BRANCHES.items())
            raise ValueError(
                f"Activation.triton_code of {self.name!r} must be None or the code of a Triton kernel branch, "
                f"one of {codes}; got {self.triton_code!r}. The kernels compute no other activation: a new one "
                f"needs its branch in kernels/activation.py and its entry in activations.TRITON_BRANCHES first")
        name, branch = found
        if branch.pattern != self.pattern:
            raise ValueError(
                f"Activation.triton_code {self.triton_code} of {self.name!r} is the Triton kernels' {name} branch, "
                f"which computes {branch.pattern!r}; the entry's pattern is {self.pattern!r}")


_REGISTRY: dict[str, Activation] = {}


def register_activation(entry: Activation) -> Activation:
    """Add `entry`; every later check, match, fake shape and lowering sees it."""
    if not isinstance(entry, Activation):
        raise ValueError(f"register_activation takes an Activation; got {entry!r}")
    if entry.name in _REGISTRY:
        raise ValueError(f"activation {entry.name!r} is already registered; unregister_activation it first")
    taken = [e.name for e in _REGISTRY.values() if entry.triton_code is not None and e.triton_code == entry.triton_code]
    if taken:
        raise ValueError(f"Activation.triton_code {entry.triton_code} of {entry.name!r} is {taken[0]!r}'s already")
    nonzero = _nonzero_at_zero(entry)
    if entry.zero_at_zero != (nonzero is None):
        found = f"gives {nonzero}" if nonzero else "gives 0 on every zero row"
        raise ValueError(f"Activation.zero_at_zero of {entry.name!r} is {entry.zero_at_zero}, but its forward {found}")
    _REGISTRY[entry.name] = entry
    return entry


# Values for the other half of a gated activation's zero-row probe: both signs, below and
# above 1, large.
_PROBE = (-1e4, -2.5, -0.5, 0.25, 1.0, 3.0, 1e4)


def _nonzero_at_zero(entry: Activation) -> Optional[str]:
    """Where ``entry.forward`` is not 0 on a zero row (described), or None: rows of +0 and
    -0 (exact: f(0) is what the forward computes at 0), and for a gated activation a zero
    gate or up row beside probe values (``_PROBE``); at scales 0.5 and 4 when it takes one."""
    zero = torch.tensor([0.0, -0.0] * (len(_PROBE) // 2) + [0.0])
    probe = torch.tensor(_PROBE)
    rows = [("0", zero)]
    if entry.gated:
        rows = [("gate = up = 0", torch.cat((zero, zero))), ("gate = 0", torch.cat((zero, probe))),
                ("up = 0", torch.cat((probe, zero)))]
    for scale in (0.5, 4.0) if entry.takes_scale else (None,):
        for what, c in rows:
            f = entry.forward(c.unsqueeze(0), scale)
            if not bool((f == 0).all()):
                at = f" at scale {scale}" if scale is not None else ""
                return f"{f.flatten().tolist()} where {what}{at}"
    return None


def unregister_activation(name: str) -> Activation:
    """Remove the activation `name`; returns its entry."""
    return _REGISTRY.pop(get_activation(name).name)


def get_activation(name: str, argument: str = "activation") -> Activation:
    """The entry of `name`; a ValueError naming `argument` and the registered names if none."""
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"{argument} must be one of {activation_names()}; got {name!r}")
    return entry


def activation_names() -> tuple[str, ...]:
    """The registered names, built-ins first, in registration order."""
    return tuple(_REGISTRY)


# ----------------------------------------------------------------------------- reference math


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (the contract); fp64 stays fp64 so gradcheck can run."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _srelu_forward(c: torch.Tensor, scale: None) -> torch.Tensor:
    r = torch.relu(c)
    return r * r


def _srelu_backward(gp: torch.Tensor, c: torch.Tensor, scale: None) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.relu(c)
    return gp * (2 * r), r * r


def _tanh_srelu_forward(c: torch.Tensor, s: float) -> torch.Tensor:
    b = s * torch.tanh(torch.relu(c) / s)
    return b * b


def _tanh_srelu_backward(gp: torch.Tensor, c: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tanh(torch.relu(c) / s)
    b = s * t
    return gp * ((2 * b) * (1 - t * t)), b * b


def _swiglu_forward(c: torch.Tensor, scale: None) -> torch.Tensor:
    a, u = c.chunk(2, dim=-1)
    return (a * torch.sigmoid(a)) * u


def _swiglu_backward(gp: torch.Tensor, c: torch.Tensor, scale: None) -> tuple[torch.Tensor, torch.Tensor]:
    a, u = c.chunk(2, dim=-1)
    sg = torch.sigmoid(a)
    si = a * sg
    return torch.cat((gp * (u * (sg * (1 + a * (1 - sg)))), gp * si), dim=-1), si * u


# The built-ins: each 0 at 0 (relu(0) = 0; tanh(0) = 0; silu(0) * u = a * 0 = 0), each
# computed by its branch of the Triton kernels.
SRELU = register_activation(Activation(
    "srelu", gated=False, takes_scale=False, forward=_srelu_forward, backward=_srelu_backward,
    pattern=TRITON_BRANCHES["srelu"].pattern, zero_at_zero=True, triton_code=TRITON_BRANCHES["srelu"].code))
TANH_SRELU = register_activation(Activation(
    "tanh_srelu", gated=False, takes_scale=True, forward=_tanh_srelu_forward, backward=_tanh_srelu_backward,
    pattern=TRITON_BRANCHES["tanh_srelu"].pattern, zero_at_zero=True,
    triton_code=TRITON_BRANCHES["tanh_srelu"].code))
SWIGLU = register_activation(Activation(
    "swiglu", gated=True, takes_scale=False, forward=_swiglu_forward, backward=_swiglu_backward,
    pattern=TRITON_BRANCHES["swiglu"].pattern, zero_at_zero=True, triton_code=TRITON_BRANCHES["swiglu"].code))


def activation_forward(
    c: torch.Tensor, probs: Optional[torch.Tensor], activation: str, tanh_clamp_scale: Optional[float] = None
) -> torch.Tensor:
    """D = bf16(f(float(C)) * p); C (T, F1) bf16, probs (T,) or None; D (T, F) in C's dtype."""
    entry = get_activation(activation)
    dtype = compute_dtype(c)
    f = entry.forward(c.to(dtype), tanh_clamp_scale)
    if probs is not None:
        f = f * probs.to(dtype).unsqueeze(1)
    return f.to(c.dtype)


def row_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum each row of a (T, N) matrix in the pinned order used by every kernel:
    within each run of 16 columns a halving tree (x[:8] + x[8:], then 4, 2, 1), then the
    run totals added left to right. Deterministic on every device; no atomics."""
    t, n = v.shape
    part = v.reshape(t, n // BLOCK, BLOCK)
    width = BLOCK
    while width > 1:
        width //= 2
        part = part[..., :width] + part[..., width:]
    part = part.squeeze(-1)  # (T, N/16)
    total = torch.zeros(t, dtype=v.dtype, device=v.device)
    for j in range(part.shape[1]):
        total = total + part[:, j]
    return total


def activation_backward(
    g: torch.Tensor,
    c: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float] = None,
    *,
    regenerate: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """From G = dL/dD (T, F) bf16 and the saved pre-activation C (T, F1) bf16:
    dC (T, F1) in C's dtype, dp (T,) fp32 (None without probs) and, when `regenerate`, D exactly
    as ``activation_forward`` made it (the backward recompute of the fc2 input)."""
    entry = get_activation(activation)
    dtype = compute_dtype(c)
    gf, cf = g.to(dtype), c.to(dtype)
    p = probs.to(dtype).unsqueeze(1) if probs is not None else None
    gp = gf * p if p is not None else gf
    dc, f = entry.backward(gp, cf, tanh_clamp_scale)
    dp = row_sum(gf * f) if probs is not None else None
    d = None
    if regenerate:
        d = (f * p if p is not None else f).to(c.dtype)
    return dc.to(c.dtype), dp, d
