"""The one-way import rule of docs/architecture.md, checked on the source: every import of every module
(function-local ones included) goes to the module's own layer or a layer above it (earlier in LAYERS)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent

# The layers of docs/architecture.md, top (imports nothing below it) first. A module belongs to the layer
# of its longest listed prefix; "mindspeed_te" alone is the package's own __init__ (the public API).
LAYERS: dict[str, tuple[str, ...]] = {
    "formats": ("mindspeed_te.formats", "mindspeed_te.hif8", "mindspeed_te.fused_cast", "mindspeed_te._fused_cast",
                "mindspeed_te.distributed", "mindspeed_te.fp4"),
    "recipe": ("mindspeed_te.recipe", "mindspeed_te.scaling"),
    "tensor": ("mindspeed_te.tensor", "mindspeed_te.nonfinite", "mindspeed_te.quantizers",
               "mindspeed_te.quantized_tensor"),
    "kernels": ("mindspeed_te.kernels",),
    "state": ("mindspeed_te.recipe_state", "mindspeed_te.state", "mindspeed_te.checkpointing", "mindspeed_te.recovery",
              "mindspeed_te.te_extra_state"),
    "ops": ("mindspeed_te.ops",),
    "modules": ("mindspeed_te.modules",),
    "optimizers": ("mindspeed_te.optimizers",),
    "megatron": ("mindspeed_te.megatron",),
    "api": ("mindspeed_te",),
    "tools": ("mindspeed_te.debug", "mindspeed_te.diagnostics", "mindspeed_te.npu_foreach"),
    # programs: the Megatron integration and what runs as `python -m` (the bench and demo apply the patches)
    "entry": ("mindspeed_te.patches", "mindspeed_te.megatron_adaptor", "mindspeed_te.launch", "mindspeed_te.bench",
              "mindspeed_te.demo", "mindspeed_te.selfcheck"),
}
RANK = {name: rank for rank, name in enumerate(LAYERS)}

# The torch_npu simulator is a test double outside the layers: it imports nothing else of the package, and
# only the module that would import torch_npu loads it in torch_npu's place (docs/architecture.md).
TEST_DOUBLE = "mindspeed_te.testing"
# (and the self-check reads from it which kernels the plugin may call, to find those a torch_npu lacks).
TEST_DOUBLE_LOADERS = {"mindspeed_te.kernels.npu", "mindspeed_te.selfcheck"}
# Device and framework libraries, and the only layers that may import them.
EXTERNAL = {"torch_npu": ("mindspeed_te.kernels.npu",), "megatron": ("megatron", "api", "tools", "entry")}


def _module_files() -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of the package; patches/ installs as mindspeed_te.patches."""
    for package, folder in (("mindspeed_te", ROOT / "mindspeed_te"), ("mindspeed_te.patches", ROOT / "patches")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


MODULES = dict(_module_files())
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
EXTENSIONS = {"mindspeed_te._fused_cast"}  # compiled from mindspeed_te/csrc: imports nothing of the package
KNOWN = set(MODULES) | EXTENSIONS


def layer_of(module: str) -> Optional[str]:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            exact_only = prefix == "mindspeed_te"
            if (module == prefix or (not exact_only and module.startswith(prefix + "."))) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if module in PACKAGES else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement and importlib.import_module("literal") call."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                # `from package import submodule` imports the submodule; anything else comes from `source`
                target = f"{source}.{alias.name}"
                yield (target if target in KNOWN else source), node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            yield node.args[0].value, node.lineno


def _own(target: str) -> Optional[str]:
    """The package module `target` names (or lies in), None for other distributions."""
    while target and target not in KNOWN:
        target = target.rpartition(".")[0]
    return target or None


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    unplaced = [name for name in MODULES if not name.startswith(TEST_DOUBLE) and layer_of(name) is None]
    assert not unplaced, f"modules with no layer (add them to LAYERS and docs/architecture.md): {unplaced}"


def test_imports_go_only_to_the_same_layer_or_above():
    offenders = []
    for module, path in MODULES.items():
        if module.startswith(TEST_DOUBLE):
            continue
        layer = layer_of(module)
        for target, line in imports(module, path):
            own = _own(target)
            if own is None or own.startswith(TEST_DOUBLE):
                continue
            target_layer = layer_of(own)
            if RANK[target_layer] > RANK[layer]:
                offenders.append(f"{_where(path, line)}: {module} ({layer}) imports {own} ({target_layer})")
    assert not offenders, "imports of a lower layer:\n" + "\n".join(offenders)


def test_the_simulator_is_independent_and_loaded_in_one_place():
    offenders = []
    for module, path in MODULES.items():
        inside = module.startswith(TEST_DOUBLE)
        for target, line in imports(module, path):
            own = _own(target)
            if own is None:
                continue
            if inside and not own.startswith(TEST_DOUBLE):
                offenders.append(f"{_where(path, line)}: the simulator module {module} imports {own}")
            if not inside and own.startswith(TEST_DOUBLE) and module not in TEST_DOUBLE_LOADERS:
                offenders.append(f"{_where(path, line)}: {module} imports the simulator ({own})")
    assert not offenders, "\n".join(offenders)


def test_device_and_framework_libraries_are_imported_only_where_allowed():
    offenders = []
    for module, path in MODULES.items():
        if module.startswith(TEST_DOUBLE):
            continue
        for target, line in imports(module, path):
            library = target.split(".")[0]
            allowed = EXTERNAL.get(library)
            if allowed is not None and module not in allowed and layer_of(module) not in allowed:
                offenders.append(f"{_where(path, line)}: {module} ({layer_of(module)}) imports {target}")
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_local_relative_and_dynamic_imports(tmp_path):
    """The checker itself: a function-local import, a relative import and import_module are all found."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from mindspeed_te.debug import numerics\n"
                      "from . import formats\n"
                      "import importlib\nimportlib.import_module('mindspeed_te.patches')\n")
    found = {target for target, _ in imports("mindspeed_te.ops.probe", source)}
    assert {"mindspeed_te.debug.numerics", "mindspeed_te.ops", "mindspeed_te.patches"} <= found
    assert layer_of("mindspeed_te.ops.probe") == "ops" and layer_of("mindspeed_te.megatron_adaptor") == "entry"
