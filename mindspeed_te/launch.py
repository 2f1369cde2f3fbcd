"""Run a Megatron training script with mindspeed_te in place of TransformerEngine:

    python -m mindspeed_te.launch pretrain_gpt.py --transformer-impl transformer_engine --fp8-format hif8 ...

The script's directory goes first on sys.path (so its `megatron` package, with megatron.training, is the
one patched), every patch is applied (TE modules, argument hooks, and the CPU device adaptor when there is
no accelerator), and the script runs as __main__ with the remaining arguments. torchrun works the same way:
`torchrun --nproc-per-node 2 -m mindspeed_te.launch pretrain_gpt.py ...`.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script, *rest = argv
    if not os.path.isfile(script):
        raise SystemExit(f"mindspeed_te.launch: training script {script!r} not found")
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    importlib.import_module("mindspeed_te.megatron_adaptor")  # applies the patches

    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
