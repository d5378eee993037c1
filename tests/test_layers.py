"""Every import in the package points down its layers (docs/architecture.md): face ->
compiler -> eager ops -> lowerings -> kernels -> numerics -> containers -> formats. Read
from the source with ast, so a lazy import inside a function counts too."""

import ast
import pathlib

import nvfp4_inductor

ROOT = pathlib.Path(nvfp4_inductor.__file__).parent
# Layer of each module (dotted, relative to the package), highest first; a package folder
# stands for every module in it.
LAYERS = [
    ("face", {"__init__", "inspection", "demo"}),
    ("compiler", {"compiler"}),
    ("eager ops", {"nn", "program", "ops", "quantize", "validate", "distributed", "weight_cache"}),
    ("lowerings", {"lowerings"}),
    ("kernels", {"kernels"}),
    ("numerics", {"numerics", "activations"}),
    ("containers", {"tensor", "recipe", "saved"}),
    ("formats", {"formats", "constants", "sizes"}),
]


def layer_of(module: str) -> int:
    for rank, (_, names) in enumerate(LAYERS):
        if module in names or module.split(".")[0] in names:
            return rank
    raise AssertionError(f"module {module} is in no layer of tests/test_layers.py")


def imports_in(source: str, module: str) -> set[str]:
    """The package modules imported by `source`, the text of `module` (dotted from the
    package; a package's own ``__init__`` is ``pkg.__init__``), relative or absolute."""
    package = module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            names = [node.module] if node.module else [a.name for a in node.names]
            found |= {".".join(base + name.split(".")) for name in names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nvfp4_inductor."):
            found.add(node.module.removeprefix("nvfp4_inductor."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("nvfp4_inductor.") for a in node.names if a.name.startswith("nvfp4_inductor.")}
    return {f for f in found if f}


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts), path.read_text()


def test_every_import_points_down_the_layers():
    upward = []
    for module, source in modules():
        for target in imports_in(source, module):
            if layer_of(target) < layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_numerics_imports_only_formats_constants_and_containers():
    allowed = {"formats", "constants", "tensor", "recipe", "saved"}
    assert imports_in((ROOT / "numerics.py").read_text(), "numerics") <= allowed


def test_the_check_resolves_relative_imports():
    assert imports_in("from ..compiler import fused\nfrom . import config\n", "kernels.x") == {
        "compiler", "kernels.config"}
    assert imports_in("from .policy import Plan\n", "lowerings.__init__") == {"lowerings.policy"}
    assert layer_of("kernels.x") > layer_of("compiler.fused")
