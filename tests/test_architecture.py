"""The package's layering, checked from its source: imports point down the layers, with no cycle and no
private name taken from another module, and function-level imports are only for optional or heavy ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_attnscale"
# Each layer may import the layers listed after it (and itself), never those before it.
LAYERS = [
    "cli",
    "training",
    "integrations",
    "diagnostics",
    "evaluation",
    "streaming",
    "checkpoints",
    "core",
]
# The core's rooms, in the same order: the patch in force (install) installs the methods of key parts (parts),
# which run on the attention call (call), which reads
# the options; ``core/compat.py``, at the core's root, is below them all.
CORE_ROOMS = ["install", "parts", "call", "options"]
CORE_ROOT_FILES_AT_MOST = 5
# Function-level imports that are allowed: optional dependencies, and heavy imports needed on first use only.
# The command line imports what each command needs when it runs, so that --help answers at once.
LAZY_PACKAGE = "hf_attnscale.cli"
LAZY_ALLOWED = (
    "hf_attnscale.diagnostics.plots",  # matplotlib
    "peft",
    "accelerate",  # the [peft] extra: only processes that are joined need it (evaluation/processes.py)
    "lm_eval",
    "matplotlib",
    "datasets",
    "nltk",  # the [ruler] extra
    "torch.nn.attention.flex_attention",
    "transformers.models.auto",
)


def _modules() -> dict[str, ast.Module]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): ast.parse(
            path.read_text()
        )
        for path in PACKAGE.rglob("*.py")
    }


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module, is_package: bool):
    """(imported module, imported names, is at module level, line) for every import in ``tree``.

    Imports under ``if TYPE_CHECKING:`` at module level count as module level (they never run).
    """
    top = {id(node) for node in tree.body}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            top |= {id(child) for child in node.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield (
                _absolute(module, node, is_package),
                [a.name for a in node.names],
                id(node) in top,
                node.lineno,
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], id(node) in top, node.lineno


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hf_attnscale" else None


MODULES = _modules()
PACKAGES = {name for name in MODULES if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}


def test_no_private_name_crosses_a_module():
    offences = [
        f"{module}:{line} imports {name} from {target}"
        for module, tree in MODULES.items()
        for target, names, _, line in _imports(module, tree, module in PACKAGES)
        if target.startswith("hf_attnscale")
        for name in names
        if name.startswith("_") and name != "__version__"
    ]
    assert not offences, offences


def test_function_level_imports_are_optional_or_heavy():
    offences = [
        f"{module}:{line} imports {target} inside a function"
        for module, tree in MODULES.items()
        if module != LAZY_PACKAGE and not module.startswith(LAZY_PACKAGE + ".")
        for target, _, at_top, line in _imports(module, tree, module in PACKAGES)
        if not at_top and not target.startswith(LAZY_ALLOWED) and target != "__future__"
    ]
    assert not offences, offences


def test_no_module_imports_the_package_root():
    # The root re-exports every layer, so importing it (``import hf_attnscale as hfa``) would hide which
    # layers a module really uses from the layer check below.
    offences = [
        f"{module}:{line} imports the package root ({target})"
        for module, tree in MODULES.items()
        if module != "hf_attnscale"
        for target, _, _, line in _imports(module, tree, module in PACKAGES)
        if target == "hf_attnscale"
    ]
    assert not offences, offences


def test_imports_point_down_the_layers():
    offences = []
    for module, tree in MODULES.items():
        mine = _layer(module)
        if mine is None or mine not in LAYERS:
            continue
        for target, _, _, line in _imports(module, tree, module in PACKAGES):
            theirs = _layer(target)
            if theirs in LAYERS and LAYERS.index(theirs) < LAYERS.index(mine):
                offences.append(f"{module}:{line} ({mine}) imports {target} ({theirs}), a layer above it")
    assert not offences, offences


def test_import_graph_has_no_cycle():
    graph = {
        module: {
            target
            for target, _, _, _ in _imports(module, tree, module in PACKAGES)
            if target in MODULES and target != module
        }
        for module, tree in MODULES.items()
    }
    done, active, cycles = set(), [], []

    def visit(node: str) -> None:
        if node in active:
            cycles.append([*active[active.index(node) :], node])
            return
        if node in done:
            return
        active.append(node)
        for target in graph[node]:
            visit(target)
        active.pop()
        done.add(node)

    for node in graph:
        visit(node)
    # A package's __init__ re-exporting its modules is not a cycle of the code itself.
    real = [c for c in cycles if not any(n in PACKAGES for n in c)]
    assert not real, real


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "core" and parts[2] in CORE_ROOMS else None


def test_core_rooms_import_downwards():
    offences = [
        f"{module}:{line} ({_room(module)}) imports {target} ({_room(target)}), a room above it"
        for module, tree in MODULES.items()
        if _room(module) is not None
        for target, _, _, line in _imports(module, tree, module in PACKAGES)
        if _room(target) is not None and CORE_ROOMS.index(_room(target)) < CORE_ROOMS.index(_room(module))
    ]
    assert not offences, offences


def test_core_root_holds_only_its_rooms_and_compat():
    root_files = sorted(path.name for path in (PACKAGE / "core").glob("*.py"))
    assert len(root_files) <= CORE_ROOT_FILES_AT_MOST, root_files
    assert sorted(p.name for p in (PACKAGE / "core").iterdir() if (p / "__init__.py").is_file()) == sorted(
        CORE_ROOMS
    )


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_is_a_folder(layer):
    assert (PACKAGE / layer / "__init__.py").is_file()
