"""Which compile caches the test processes use. Off: Inductor's FX graph cache, AOTAutograd's
cache and Dynamo's profile of dynamic sizes, whose keys miss our graph passes' node tags and
edits to our ops, so a hit could answer with older code. On: the kernel caches, keyed by each
kernel's generated source, which cannot: two compiles of one program (compare's two sides;
stock Inductor against a site kept in BF16) build each C++ kernel once, where
``TORCHINDUCTOR_FORCE_DISABLE_CACHES`` rebuilds every kernel at every compile. Environment
variables, not config patches: they hold in every thread and child process, and no patch
overrides them."""

GRAPH_CACHES_OFF = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO": "0",
}


def with_graph_caches(environ) -> dict:
    """`environ` for a child process that tests the graph caches themselves: every cache on."""
    off = set(GRAPH_CACHES_OFF) | {"TORCHINDUCTOR_FORCE_DISABLE_CACHES"}
    return {k: v for k, v in environ.items() if k not in off}
