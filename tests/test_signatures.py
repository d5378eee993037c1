"""Options travel as objects: no function of the package takes more than 12 parameters but
the op bodies that ``torch.library`` schemas define (and their fake impls), Triton kernels
(their parameters are launch arguments), the stand-ins for vendor APIs, and the graph-level
call of a rewritten site; and the fused ops' options cross their schemas through one
function each way (``fused.schema_kwargs`` / ``fused.site_options_from``)."""

import ast
import inspect
import pathlib

import pytest

import nvfp4_inductor
from nvfp4_inductor.compiler import fused
from nvfp4_inductor.lowerings import Plan
from nvfp4_inductor.program import SiteOptions
from nvfp4_inductor.recipe import Recipe

ROOT = pathlib.Path(nvfp4_inductor.__file__).parent
MOST = 12
# Decorators that make a function an op body or a kernel: its parameters are a schema's or a launch's.
SCHEMA_DECORATORS = ("custom_op", "target_op", "kernel_op", "register_fake", "triton.jit")
# The stand-ins for the vendor's wrappers (their signatures are the vendor's), and the flat
# call a rewritten graph makes (its constants print by name and key AOTAutograd's cache); by
# file name, wherever the file sits.
ALLOWED = {"cudnn_sim.py": "*", "fused.py": "fused_grouped_mlp"}


def _parameters(node: ast.FunctionDef) -> int:
    a = node.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def _defines_schema(node: ast.FunctionDef) -> bool:
    return any(name in ast.unparse(d) for d in node.decorator_list for name in SCHEMA_DECORATORS)


def test_no_function_takes_more_than_twelve_parameters():
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _parameters(node) <= MOST:
                continue
            if _defines_schema(node) or ALLOWED.get(path.name) in ("*", node.name):
                continue
            over.append(f"{module}:{node.lineno} {node.name} takes {_parameters(node)}")
    assert not over, "functions over 12 parameters (pass an options object):\n" + "\n".join(over)


def test_the_rule_sees_a_long_signature():
    node = ast.parse("def f(" + ", ".join(f"a{i}" for i in range(13)) + "): pass").body[0]
    assert _parameters(node) == 13 and not _defines_schema(node)


OPTIONS = SiteOptions("tanh_srelu", 2.0, Recipe(sign_mask=0x1234, sr_per_rank=False),
                      Plan("reference", True, False, True, ""), recompute=True, reuse_weight_casts=True,
                      weight_derivation="fc1 = W1")


@pytest.mark.parametrize("fn", [fused.grouped_mlp_infer, fused.grouped_mlp_fwd, fused.grouped_mlp_bwd_fc2,
                                fused.fused_grouped_mlp], ids=lambda fn: getattr(fn, "__name__", str(fn)))
def test_each_ops_options_are_exactly_the_schema_fields(fn):
    body = getattr(fn, "_init_fn", fn)
    keyword_only = [p.name for p in inspect.signature(body).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keyword_only == list(fused.schema_kwargs(OPTIONS))


def test_options_cross_the_schema_and_back():
    assert fused.site_options_from(fused.schema_kwargs(OPTIONS)) == OPTIONS
