"""Bit fingerprints of the grouped MLP's outputs and gradients, to prove a refactor
changes no bit: run it before and after, then ``--compare before.json after.json``.

    python benchmarks/fingerprint.py --out before.json [--device cuda]
    python benchmarks/fingerprint.py --compare before.json after.json

Cases: every activation x three recipes (default with stochastic rounding; no RHT / no SR
/ 1x16 weight blocks; sign mask 0), eager ``GroupedMLP`` and compiled (nvfp4 backend,
AOTAutograd without Inductor, recompute on and off); one Inductor case per activation.
Each tensor is reduced to the sha256 of its bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

import nvfp4_inductor as nv

EXPERTS, HIDDEN, FFN, TOKENS = 4, 64, 48, 200
RECIPES = {
    "default": nv.Recipe(),
    "plain": nv.Recipe(rht=False, stochastic_rounding=False, block_2d=False),
    "mask0": nv.Recipe(sign_mask=0),
}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _case(device, activation, recipe, run):
    torch.manual_seed(0)
    clamp = 4.0 if activation == "tanh_srelu" else None
    mlp = nv.GroupedMLP(EXPERTS, HIDDEN, FFN, activation, clamp, recipe, device=device)
    x = torch.randn(TOKENS, HIDDEN, device=device).bfloat16().requires_grad_()
    sizes = torch.tensor([70, 0, 64, 66], device=device)
    probs = torch.rand(TOKENS, device=device).requires_grad_()
    dy = torch.randn(TOKENS, HIDDEN, device=device).bfloat16()
    torch._dynamo.reset()
    if run == "eager":
        fn = mlp
    else:
        compiler, recompute = run.split("/")
        fn = torch.compile(mlp, backend=nv.backend(recipe=recipe, recompute=recompute == "recompute",
                                                   compiler=compiler))
    torch.manual_seed(1)  # the stochastic rounding seeds
    y = fn(x, sizes, probs)
    grads = torch.autograd.grad(y, (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy)
    return {name: _digest(t) for name, t in zip(("Y", "dX", "dW1", "dW2", "dprobs"), (y, *grads))}


def fingerprints(device: str) -> dict:
    out = {}
    for activation in ("srelu", "tanh_srelu", "swiglu"):
        for recipe_name, recipe in RECIPES.items():
            runs = ["eager", "aot_eager/recompute", "aot_eager/save"]
            if recipe_name == "default":
                runs.append("inductor/recompute")
            for run in runs:
                out[f"{device} {activation} {recipe_name} {run}"] = _case(device, activation, recipe, run)
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    differ = [f"{case} {name}" for case in a for name in a[case] if b.get(case, {}).get(name) != a[case][name]]
    missing = sorted(set(a) ^ set(b))
    print(f"{len(a)} cases, {sum(map(len, a.values()))} tensors: {len(differ)} differ, {len(missing)} missing")
    for line in differ + [f"missing: {m}" for m in missing]:
        print("  ", line)
    return 1 if differ or missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    result = fingerprints(args.device)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        open(args.out, "w").write(text)
    print(f"{len(result)} cases fingerprinted on {args.device}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
