"""The megatron-core release matrix: the plugin's megatron-core tests against each supported release, installed
from the package registry into a directory of its own, and against the Megatron-LM trees of MEGATRON_LM_TREES
(paths separated by os.pathsep) whose release the registry does not serve on this Python (0.17 on).

    python -m tests.megatron_matrix                 # every release but the pinned one, and the trees (CI)
    python -m tests.megatron_matrix 0.12.1 -- -x    # one release; pytest arguments after --

The pinned release (requirements-dev.txt) runs the whole suite. A tree of a release that needs Python 3.12 runs
on an older Python with tests/py312_shim first on PYTHONPATH (the plugin itself needs no shim).
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
# release -> how it is tested (the README's support table is checked against this)
REGISTRY_RELEASES = ("0.12.1", "0.13.1", "0.14.0", "0.15.3", "0.16.1")
SOURCE_RELEASES = ("0.17.1", "0.18.2", "0.19.0")
# The plugin's megatron-core tests: TE* modules and specs, GPT through Megatron's schedules in each recipe,
# MoE, FP8 parameters, the fused paths, sharded (distributed) checkpoints, the optimizer patches.
MEGATRON_TESTS = ("tests/test_patches_megatron.py", "tests/test_patches_registry.py", "tests/test_megatron_linear.py",
                  "tests/test_megatron_misc.py", "tests/test_megatron_moe.py", "tests/test_megatron_moe_fused.py",
                  "tests/test_megatron_mla_rope.py", "tests/test_megatron_te_methods.py",
                  "tests/test_fp8_param_megatron.py", "tests/test_patches_optimizer.py", "tests/test_hif8_delayed.py",
                  "tests/test_checkpoint.py")
TARGETS = ROOT / ".venv" / "megatron-core"
SHIM = ROOT / "tests" / "py312_shim"


def trees() -> list[pathlib.Path]:
    """The Megatron-LM trees of MEGATRON_LM_TREES."""
    return [pathlib.Path(p).resolve() for p in os.environ.get("MEGATRON_LM_TREES", "").split(os.pathsep) if p]


def tree_release(tree: pathlib.Path) -> str:
    """The megatron-core release of a Megatron-LM tree, read from its package_info.py."""
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    parts = [re.search(rf"^{name} = (\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ValueError(f"{tree}: no MAJOR / MINOR / PATCH in megatron/core/package_info.py")
    return ".".join(part.group(1) for part in parts)


# The file-name suffix of Megatron's dataset helpers: this interpreter's, whatever `python3-config` says in the tree.
HELPERS_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def build_dataset_helpers(tree) -> None:
    """Megatron's C++ dataset helpers in `tree`, built for this interpreter: its Makefile asks `python3` for
    pybind11's headers and `python3-config` for the suffix, which may belong to another Python."""
    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True)
    if includes.returncode:
        raise RuntimeError(f"{sys.executable} has no pybind11 for Megatron's dataset helpers (docs/megatron.md: "
                           "pip install six regex pyyaml pydantic pybind11 triton psutil einops)")
    build = subprocess.run(["make", "-s", "-C", os.path.join(tree, "megatron", "core", "datasets"),
                            f"LIBEXT={HELPERS_SUFFIX}", f"CPPFLAGS={includes.stdout.strip()}"],
                           capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(f"building Megatron's dataset helpers in {tree} failed:\n{build.stderr[-3000:]}")


def helpers_env() -> dict[str, str]:
    """Environment for a run of a tree's training code. Megatron rebuilds its dataset helpers at start-up with a
    bare `make`, which names them by `python3-config`: under pyenv, the tree's .python-version picks another
    Python there. This keeps the name `build_dataset_helpers` gave them, so that make finds them built."""
    flags = f"{os.environ.get('MAKEFLAGS', '')} LIBEXT={HELPERS_SUFFIX}".strip()
    return {"MAKEFLAGS": flags}


def python_path(tree: pathlib.Path) -> str:
    """PYTHONPATH for running `tree`'s Megatron here: the shim first where its release needs Python 3.12."""
    needs_312 = tuple(map(int, tree_release(tree).split(".")[:2])) >= (0, 17) and sys.version_info < (3, 12)
    return os.pathsep.join([*([str(SHIM)] if needs_312 else []), str(tree)])


def pinned_release() -> str:
    """The megatron-core release the environment pins (requirements-dev.txt), which runs the whole suite."""
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        if line.startswith("megatron-core=="):
            return line.split("==")[1].split()[0]
    raise RuntimeError("requirements-dev.txt pins no megatron-core release")


def install(release: str) -> pathlib.Path:
    """megatron-core==`release` in a directory of its own (once), without dependencies: the environment has them."""
    target = TARGETS / release
    if not (target / "megatron" / "core").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        f"megatron-core=={release}"], check=True)
    return target


def run(name: str, path: str, pytest_args: list[str]) -> int:
    """The megatron-core tests with `path` (a release's directory, or a tree's) first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
    print(f"== megatron-core {name}", flush=True)
    return subprocess.run([sys.executable, "-m", "pytest", *pytest_args, *MEGATRON_TESTS], env=env, cwd=ROOT).returncode


def main(argv: list[str]) -> int:
    releases, _, pytest_args = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, None, [])
    unknown = set(releases) - set(REGISTRY_RELEASES)
    if unknown:
        raise SystemExit(f"not a registry release of the matrix: {sorted(unknown)}; choose from {REGISTRY_RELEASES}")
    runs = {release: str(install(release)) for release in releases or REGISTRY_RELEASES
            if releases or release != pinned_release()}
    if not releases:
        runs.update({f"{tree_release(tree)} ({tree})": python_path(tree) for tree in trees()
                     if tree_release(tree) not in REGISTRY_RELEASES})
    failed = [name for name, path in runs.items() if run(name, path, pytest_args) != 0]
    print(f"megatron-core matrix: {len(runs) - len(failed)} releases passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
