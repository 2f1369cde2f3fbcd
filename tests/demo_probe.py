"""The start of a probe script that the demo tests run in a fresh process: the demo's set-up for a tiny GPT
(`steps` steps, hidden 64, sequence 64, batch 4), its corpus, and `built`, every run's (gpt, model, optimizer, ...)
as the demo's build() returns it. The tests append what they read from them."""
from __future__ import annotations

import textwrap


def probe_start(steps: int) -> str:
    return textwrap.dedent(f"""
        import json, os, sys
        from mindspeed_te.demo import train as demo
        from mindspeed_te.demo.corpus import load_corpus, val_batches

        args = demo.parse_args(["--steps", "{steps}", "--eval-interval", "{steps}", "--eval-batches", "1",
                                "--hidden", "64", "--seq-length", "64", "--batch-size", "4"])
        demo.setup_megatron()
        corpus = load_corpus()
        val = val_batches(corpus.val, 1, 4, 64)
        built, build = {{}}, demo.build

        def spy(args, run, seed):
            built[run] = parts = build(args, run, seed)
            return parts

        demo.build = spy
    """)
