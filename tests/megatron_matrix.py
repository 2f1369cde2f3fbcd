"""The megatron-core release matrix: each supported release that installs on this Python, from the package
registry into a directory of its own, with the plugin's megatron-core tests run against it.

    python -m tests.megatron_matrix                 # every release but the environment's own (CI)
    python -m tests.megatron_matrix 0.12.1 -- -x    # one release; pytest arguments after --

The environment's own release (requirements-dev.txt) runs the whole suite; the others run MEGATRON_TESTS. The
releases that need Python 3.12 (0.17 on) are not on the registry for 3.11: their source trees run through
tests/test_megatron_source.py (MEGATRON_LM_PATH).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

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


def run(release: str, pytest_args: list[str]) -> int:
    """The megatron-core tests against `release`: its directory first on PYTHONPATH."""
    path = install(release)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])))
    print(f"== megatron-core {release}", flush=True)
    return subprocess.run([sys.executable, "-m", "pytest", *pytest_args, *MEGATRON_TESTS], env=env, cwd=ROOT).returncode


def main(argv: list[str]) -> int:
    releases, _, pytest_args = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, None, [])
    unknown = set(releases) - set(REGISTRY_RELEASES)
    if unknown:
        raise SystemExit(f"not a registry release of the matrix: {sorted(unknown)}; choose from {REGISTRY_RELEASES}")
    releases = releases or [r for r in REGISTRY_RELEASES if r != pinned_release()]
    failed = [release for release in releases if run(release, pytest_args) != 0]
    print(f"megatron-core matrix: {len(releases) - len(failed)} releases passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
