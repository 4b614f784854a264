"""The package's structure: no import cycles (function-level imports included), layering.

A static scan of ``lppo/`` and ``callbacks/`` (the source of ``lppo.callbacks``): every
``import`` statement, at any depth (module level, in a function, under ``TYPE_CHECKING``),
is an edge from its module to the lppo module it names. A cycle through those edges is a
tangle that one change can no longer be made in; none is allowed except the ones listed in
:data:`ALLOWED`, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``(importer, imported)`` edges that may close a cycle, with the reason they exist.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "callbacks":
        parts = ["lppo", "callbacks", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def sources() -> dict[str, Path]:
    files = sorted((ROOT / "lppo").rglob("*.py")) + sorted((ROOT / "callbacks").rglob("*.py"))
    return {module_name(p): p for p in files}


def resolve(name: str, known: set[str]) -> str | None:
    """The lppo module ``name`` refers to (a module, or the package holding a name)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every lppo module ``module`` imports, at any depth of its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            if name.startswith("lppo") and (target := resolve(name, known)) not in (None, module):
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    files = sources()
    known = set(files)
    edges = {m: imports(m, p, known) for m, p in files.items()}
    # A package's __init__ re-exports its modules; importing a package's module does not
    # import the modules its __init__ re-exports, so edges *to a package* count, edges from
    # a module to its own parent package are what `import lppo.x.y` runs first: not an edge
    # of the code's design. Drop parent-package edges.
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_function_level_imports() -> None:
    edges = graph()
    # callbacks/hf_export.py imports lppo.run.export inside a method (see its comment).
    assert "lppo.run.export" in edges["lppo.callbacks.hf_export"]
    assert "lppo.iteration.hooks" in edges["lppo.iteration.controller"]


def test_no_import_cycles() -> None:
    edges = graph()
    for a, b in ALLOWED:
        edges[a].discard(b)
    found = cycles(edges)
    assert found == [], "import cycles (each a strongly connected set of modules):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_controller_imports_no_callback() -> None:
    edges = graph()
    assert not {t for t in edges["lppo.iteration.controller"] if t.startswith("lppo.callbacks")}


def test_layering() -> None:
    """replay knows nothing of the algorithm config or the modules; algorithms hold no state."""
    edges = graph()
    for module, targets in edges.items():
        if module.startswith("lppo.replay"):
            assert not {"lppo.config", "lppo.iteration.controller"} & targets, module
            assert not {t for t in targets if t.startswith("lppo.modules")}, module
        if module.startswith("lppo.algorithms"):
            allowed = {"lppo.algorithms", "lppo.stats", "lppo.validation", "lppo.types"}
            stray = {t for t in targets if not t.startswith("lppo.algorithms.")} - allowed
            assert not stray, (module, stray)


#: ``(importer, concrete layout module)`` imports allowed outside ``lppo/layouts/``, with why.
LAYOUT_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("lppo.modules.megatron.model", "lppo.layouts.megatron"): (
        "a megatron spec built outside lppo's strategy (a script, a test) takes megatron's "
        "groups itself; under the strategy the layout hands them over"
    ),
}


def concrete_layout_modules() -> set[str]:
    """The modules of ``lppo/layouts/`` that implement a registered layout (not the registry)."""
    from lppo.layouts import LAYOUTS

    modules = {cls.__module__ for cls, _ in LAYOUTS.values()}
    # lppo.layouts.base is the seam itself (the protocol, the context, the default replicas)
    return {m for m in modules if m.startswith("lppo.layouts.") and m != "lppo.layouts.base"}


def test_only_the_layouts_and_the_strategy_know_concrete_layouts() -> None:
    """Modules and engines reach weights and groups through ``ParallelLayout``, not a layout's
    own helpers: only ``lppo/layouts/`` imports a concrete layout module (the registry in
    ``lppo/layouts/__init__.py`` included); ``lppo.runtime.strategy`` takes the registry."""
    concrete = concrete_layout_modules()
    assert {"lppo.layouts.fsdp", "lppo.layouts.megatron"} <= concrete
    edges = graph()
    stray = {
        (module, target)
        for module, targets in edges.items()
        if not module.startswith("lppo.layouts")
        for target in targets & concrete
    } - set(LAYOUT_IMPORTS_ALLOWED)
    assert stray == set(), stray
    registry_users = {
        m for m, ts in edges.items() if "lppo.layouts" in ts and not m.startswith("lppo.layouts")
    }
    assert registry_users == {"lppo.runtime.strategy"}


def test_the_parallel_context_holds_no_megatron_code() -> None:
    """megatron-core's groups belong to its layout (``lppo/layouts/megatron.py``): no name,
    import or string of ``lppo/parallel.py``'s code (docstrings aside) mentions megatron."""
    tree = ast.parse((ROOT / "lppo" / "parallel.py").read_text())
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes) and node.body and isinstance(node.body[0], ast.Expr)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                names.add(node.value)
    assert "ProcessGroup" in names  # the scan reads the file's code
    assert {n for n in names if "megatron" in n.lower()} == set()


def test_the_architecture_page_names_every_module() -> None:
    """``docs/concepts/architecture.md`` is the design map: every module and its job."""
    page = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    files = [*(ROOT / "lppo").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]
    missing = [str(p.relative_to(ROOT)) for p in files if f"`{p.relative_to(ROOT)}`" not in page]
    assert missing == []
