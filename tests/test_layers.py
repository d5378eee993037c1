"""Every import in the package points down its layers (docs/architecture.md): testing ->
face -> compiler -> eager ops -> lowerings -> kernels -> numerics -> containers -> formats.
Read from the source with ast, so a lazy import inside a function counts too; and no module
imports one of the package's modules by name (``importlib``, ``__import__``, ``sys.modules``),
an edge this check could not see."""

import ast
import pathlib

import nvfp4_inductor

ROOT = pathlib.Path(nvfp4_inductor.__file__).parent
# Layer of each module (dotted, relative to the package), highest first; a package folder
# stands for every module in it.
LAYERS = [
    ("testing", {"testing"}),
    ("face", {"__init__", "inspection", "demo", "check"}),
    ("compiler", {"compiler"}),
    ("eager ops", {"nn", "program", "ops", "target_ops", "quantize", "validate", "distributed", "weight_cache"}),
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


_IMPORT_CALLS = {"importlib.import_module", "import_module", "__import__", "importlib.__import__"}


def imports_by_name(source: str) -> set[str]:
    """The expressions in `source` that import a module by name, which ``imports_in`` cannot
    see: every ``importlib.import_module`` / ``__import__`` call (an import statement says
    the same), and every ``sys.modules`` lookup whose key is not a string constant naming a
    module outside the package."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Call) and ast.unparse(node.func) in _IMPORT_CALLS:
            found.add(ast.unparse(node))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith("sys.modules."):
            key = node.args[0] if node.args else node
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            key = node.slice
        if key is not None and not (isinstance(key, ast.Constant) and isinstance(key.value, str)
                                    and not key.value.startswith(("nvfp4_inductor", "."))):
            found.add(ast.unparse(node))
    return found


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


def test_no_module_imports_a_module_by_name():
    found = {module: names for module, source in modules() if (names := imports_by_name(source))}
    # the one lookup by a computed name: the module class that Dynamo's nn_module_stack
    # names (a user's, or ours), for the file that defines it; not an import of ours
    assert found == {"compiler.site": {"sys.modules.get(module_name)"}}


def test_numerics_imports_only_formats_constants_and_containers():
    allowed = {"formats", "constants", "tensor", "recipe", "saved"}
    assert imports_in((ROOT / "numerics.py").read_text(), "numerics") <= allowed


def test_the_check_resolves_relative_imports():
    assert imports_in("from ..compiler import fused\nfrom . import config\n", "kernels.x") == {
        "compiler", "kernels.config"}
    assert imports_in("from .policy import Plan\n", "lowerings.__init__") == {"lowerings.policy"}
    assert layer_of("kernels.x") > layer_of("compiler.fused")
    lazy = "def steps():\n    from .triton import STEPS\n    return STEPS\n"
    assert imports_in(lazy, "lowerings.triton_target") == {"lowerings.triton"}


def test_the_check_sees_imports_by_name():
    source = "\n".join([
        'import importlib, sys', 'from importlib import import_module',
        'def load(name):', '    return importlib.import_module(name, __package__).STEPS',
        'import_module(".triton")', '__import__("cudnn")',
        'sys.modules.get("nvfp4_inductor.nn")', 'sys.modules["nvfp4_inductor.ops"]', 'sys.modules.get(MODULE)',
        'sys.modules.get("torch.distributed.tensor")', 'sys.modules["torch"]', ''])
    assert imports_by_name(source) == {
        "importlib.import_module(name, __package__)", "import_module('.triton')", "__import__('cudnn')",
        "sys.modules.get('nvfp4_inductor.nn')", "sys.modules['nvfp4_inductor.ops']", "sys.modules.get(MODULE)"}
