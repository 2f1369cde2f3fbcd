"""`python -m mindspeed_te.launch`: argument handling, and the script runs as __main__ with every patch applied."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "mindspeed_te.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_script_runs_as_main_with_its_arguments_and_the_patches(tmp_path):
    (tmp_path / "sibling.py").write_text("VALUE = 'found next to the script'\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        import sibling  # the script's directory is on sys.path, as with `python train.py`
        import megatron.core.extensions.transformer_engine as te_ext
        from mindspeed_te.megatron import TELinear
        print(__name__, sys.argv[1:], sibling.VALUE, te_ext.TELinear is TELinear,
              torch.zeros(1, device="cuda").device.type)
    """))
    run = _launch(str(script), "--fp8-format", "hif8", cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "__main__ ['--fp8-format', 'hif8'] found next to the script True cpu"


def test_missing_script_and_help(tmp_path):
    run = _launch("no_such_script.py", cwd=str(tmp_path))
    assert run.returncode != 0 and "training script 'no_such_script.py' not found" in run.stderr
    run = _launch("--help", cwd=str(tmp_path))
    assert run.returncode == 0 and "pretrain_gpt.py" in run.stdout


def test_without_megatron_the_adaptor_says_what_to_install(tmp_path):
    # a `megatron` package without `core` shadows the installed one
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    code = "import mindspeed_te.megatron_adaptor"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "pip install megatron-core==0.16.1" in run.stderr
