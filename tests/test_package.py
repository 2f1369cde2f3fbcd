"""The public API: TransformerEngine's names at top level, and importing the package has no side effects
(no Megatron, no torch_npu, no patches)."""
import importlib.util
import os
import re
import subprocess
import sys

import mindspeed_te

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_top_level_names():
    for name in ("Linear", "LayerNormLinear", "LayerNorm", "RMSNorm", "GroupedLinear", "DotProductAttention",
                 "fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init", "FP8GlobalStateManager",
                 "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "Format",
                 "convert_linears"):
        assert hasattr(mindspeed_te, name), name
    assert set(mindspeed_te.__all__) <= set(dir(mindspeed_te))


def test_import_has_no_side_effects():
    code = ("import sys, mindspeed_te; "
            "print(any(m.startswith(('megatron', 'torch_npu', 'mindspeed_te.patches')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_megatron_integration_installs_as_mindspeed_te_patches(tmp_path):
    """The integration folder patches/ imports as mindspeed_te.patches from anywhere, never as a top-level
    `patches` (which other distributions may also install)."""
    code = ("import importlib.util, mindspeed_te.patches.registry as r; "
            "print(r.__name__, importlib.util.find_spec('patches') is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.split() == ["mindspeed_te.patches.registry", "True"]


def test_every_public_module_class_documents_its_arguments():
    """As in TransformerEngine, each constructor argument of a public module class is described in the class
    docstring (an argument added without a description fails here)."""
    import inspect

    import mindspeed_te.modules as modules
    import mindspeed_te.optimizers as optimizers

    packages = [modules, optimizers]
    if importlib.util.find_spec("megatron.core") is not None:
        import mindspeed_te.megatron as megatron

        packages.append(megatron)
    missing = {}
    for package in packages:
        for name in package.__all__:
            cls = getattr(package, name)
            if not inspect.isclass(cls) or "__init__" not in vars(cls):
                continue
            args = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
            undocumented = [a for a in args if f"{a}:" not in cls.__doc__ and f"{a}," not in cls.__doc__]
            if undocumented:
                missing[f"{package.__name__}.{name}"] = undocumented
    assert not missing, missing


def test_readme_support_table_lists_the_tested_releases():
    """The README's table of Megatron releases is the matrix the tests run: the registry releases (CI), the
    source-tree releases, and together exactly the release lines the patches accept."""
    from mindspeed_te.patches.registry import SUPPORTED_MEGATRON_CORE
    from tests.megatron_matrix import REGISTRY_RELEASES, SOURCE_RELEASES

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    rows = {cells[0]: cells for cells in (
        [cell.strip() for cell in line.strip("|").split("|")] for line in readme.splitlines()
        if re.match(r"\| 0\.\d+\.\d+ \|", line))}
    assert list(rows) == [*REGISTRY_RELEASES, *SOURCE_RELEASES]
    assert all(rows[release][2] == "package registry" for release in REGISTRY_RELEASES)
    assert all(rows[release][2] == "Megatron-LM tree" for release in SOURCE_RELEASES)
    assert sorted({release.rsplit(".", 1)[0] for release in rows}) == sorted(SUPPORTED_MEGATRON_CORE)


def _extras_require() -> dict[str, list[str]]:
    """setup.py's extras_require, read from its syntax tree (running setup.py would build the package)."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py passes no extras_require")


def test_megatron_extra_admits_exactly_the_supported_release_lines():
    """`pip install mindspeed_te[megatron]` accepts every megatron-core release of the lines the patches support
    (mindspeed_te.patches.registry.SUPPORTED_MEGATRON_CORE) and none outside them; the test extra's pin is one
    of them."""
    from packaging.requirements import Requirement

    from mindspeed_te.patches.registry import SUPPORTED_MEGATRON_CORE

    extras = _extras_require()
    (megatron,) = [Requirement(r) for r in extras["megatron"] if Requirement(r).name == "megatron-core"]
    lines = sorted(tuple(int(p) for p in line.split(".")) for line in SUPPORTED_MEGATRON_CORE)
    for major, minor in lines:
        for patch in (0, 1, 9):
            assert megatron.specifier.contains(f"{major}.{minor}.{patch}"), (str(megatron), major, minor, patch)
    (first_major, first_minor), (last_major, last_minor) = lines[0], lines[-1]
    assert not megatron.specifier.contains(f"{first_major}.{first_minor - 1}.99"), str(megatron)
    assert not megatron.specifier.contains(f"{last_major}.{last_minor + 1}.0"), str(megatron)
    (pin,) = [Requirement(r) for r in extras["test"] if Requirement(r).name == "megatron-core"]
    assert [s.operator for s in pin.specifier] == ["=="], str(pin)
    assert megatron.specifier.contains(next(iter(pin.specifier)).version), (str(pin), str(megatron))


def test_megatron_lm_requirements_are_pinned():
    """What scripts/megatron_demo.sh installs for Megatron-LM's training code is pinned with ==, so a run gets
    the versions the tests ran with."""
    from packaging.requirements import Requirement

    path = os.path.join(ROOT, "requirements-megatron-lm.txt")
    lines = [line.split("#", 1)[0].strip() for line in open(path, encoding="utf-8")]
    requirements = [Requirement(line) for line in lines if line]
    assert requirements
    unpinned = [str(r) for r in requirements if [s.operator for s in r.specifier] != ["=="]]
    assert not unpinned, f"pin these with ==: {unpinned}"


def test_megatron_demo_installs_the_pinned_requirements_and_fails_loudly():
    script = open(os.path.join(ROOT, "scripts", "megatron_demo.sh"), encoding="utf-8").read()
    code = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert "set -euo pipefail" in code
    installs = [line for line in code if "pip install" in line]
    assert installs and all("-r \"$ROOT/requirements-megatron-lm.txt\"" in line for line in installs), installs
    assert not any("2>/dev/null" in line or "|| true" in line for line in installs)
    assert not any("|| true" in line for line in code)


def test_repository_documents_the_sources_cite_exist():
    """A document of this repository named in a source (one at its root in capitals, as README.md, or under
    docs/) is there; the vendors' pages the NPU code cites (aclnn*.md, torch_npu-*.md) are not this repository's."""
    cited = set()
    for folder in ("mindspeed_te", "patches", "tests", "scripts"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".sh")):
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                    cited |= set(re.findall(r"\b(docs/[\w.-]+\.md|[A-Z][A-Z_]+\.md)\b", text))
    missing = sorted(doc for doc in cited if not os.path.exists(os.path.join(ROOT, doc)))
    assert not missing, f"cited but not in the repository: {missing}"
