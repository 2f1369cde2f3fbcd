"""Megatron-LM's own example launch scripts and real model shapes, shrunk to a 2-process CPU run of
`python -m mindspeed_te.launch <tree>/pretrain_gpt.py` (tests/test_megatron_examples.py).

A script's flags are read by running the script itself under bash, from the tree's root, with its launchers
(torchrun, python, sbatch, srun) and mkdir replaced by functions that print the flags the script hands over and
stop, and with a PATH holding only dirname, basename and env: the script's own variables, defaults, conditionals
and word splitting decide the flags, exactly as they would on a cluster, and nothing else of it runs.

The flags then change only as OVERRIDABLE allows (sizes, run length, data, paths, parallel sizes); every other
flag reaches pretrain_gpt.py as the script writes it (`kept_flags` checks it). A case may add flags the script
lacks (a model-only config has no training flags; the FP8 recipe under test).

    python -m tests.megatron_examples /work/mlm/0.16.1 llama3-8b-fp8     # print the command, run it, show losses
    python -m tests.megatron_examples /work/mlm/0.16.1 llama3-8b-fp8 --print
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from tests import megatron_matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DROP = None  # an override value: the flag (and its values) leaves the command

# The only flags a case changes, and why. Every other flag of a script reaches pretrain_gpt.py as written.
OVERRIDABLE: dict[str, str] = {
    **dict.fromkeys((
        "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
        "--kv-channels", "--seq-length", "--max-position-embeddings", "--vocab-size",
        "--num-experts", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
        "--moe-layer-freq",  # which of the (fewer) layers are MoE layers
        "--moe-router-topk", "--moe-router-num-groups", "--moe-router-group-topk",  # to fit the fewer experts
        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
    ), "model size"),
    **dict.fromkeys((
        "--micro-batch-size", "--global-batch-size",
        # gpt3's batch-size schedules, which start at 16 (above the shrunk global batch) and which Megatron refuses
        # as the script writes them: --rampup-batch-size 16 16 5859375 (to 0.17) next to --train-iters
        # ("expected no batch-size rampup for iteration-based training"), --step-batch-size-schedule "0:16 ..."
        # (0.18 on) next to --global-batch-size ("Cannot specify both"), its quoted schedule split into words
        "--rampup-batch-size", "--step-batch-size-schedule",
    ), "batch size"),
    **dict.fromkeys((
        "--train-iters", "--train-samples", "--lr-warmup-iters", "--lr-warmup-samples", "--eval-iters",
        "--log-interval",  # a loss line every iteration (gpt3 logs every 100)
    ), "run length"),
    **dict.fromkeys((
        "--mock-data", "--data-path", "--tokenizer-type", "--tokenizer-model", "--vocab-file",
        "--merge-file", "--data-cache-path",
    ), "data"),
    **dict.fromkeys(("--save", "--load", "--tensorboard-dir"), "paths"),
    **dict.fromkeys((
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
    ), "parallel sizes (2 processes)"),
}

# Values for the flags above where a script has them (a case may give its own).
SMALL: dict[str, tuple[str, ...] | None] = {
    "--num-layers": ("2",), "--hidden-size": ("64",), "--ffn-hidden-size": ("128",),
    "--num-attention-heads": ("4",), "--num-query-groups": ("2",), "--kv-channels": ("16",),
    "--seq-length": ("64",), "--max-position-embeddings": ("64",),
    "--num-experts": ("4",), "--moe-ffn-hidden-size": ("32",), "--moe-shared-expert-intermediate-size": ("32",),
    "--micro-batch-size": ("1",), "--global-batch-size": ("4",),
    "--rampup-batch-size": DROP, "--step-batch-size-schedule": DROP,
    "--train-iters": ("3",), "--train-samples": ("12",),  # 3 iterations of 4 samples
    "--lr-warmup-iters": ("1",), "--lr-warmup-samples": ("4",), "--eval-iters": ("1",),
    "--data-path": DROP, "--tokenizer-model": DROP, "--vocab-file": DROP, "--merge-file": DROP,
}
# Set whether or not the script has them. The vocabulary holds the mock data's tokens: before 0.16 they count up
# to 4095 (MockGPTLowLevelDataset's max_sequence_length), later ones wrap around the vocabulary.
ALWAYS: dict[str, tuple[str, ...]] = {
    "--mock-data": (), "--tokenizer-type": ("NullTokenizer",), "--vocab-size": ("4096",), "--log-interval": ("1",),
}
PATHS: dict[str, tuple[str, ...]] = {  # where a script has them
    "--save": ("{tmp}/checkpoints",), "--load": ("{tmp}/checkpoints",), "--tensorboard-dir": ("{tmp}/tensorboard",),
    "--data-cache-path": ("{tmp}/data-cache",),
}

# DeepSeek-V3 as Megatron-LM's own recipe trains it: examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (from
# release 0.18), its PRETRAIN_ARGS under the script's USE_MEGATRON_FSDP=0 (no Megatron-FSDP block). Kept here
# because older releases have no such recipe; DEEPSEEK_V3_RECIPE reads it where a tree has it, and a test checks
# that the two agree.
DEEPSEEK_V3 = (
    "--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 8 "
    "--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear "
    "--micro-batch-size 4 --global-batch-size 2048 --train-samples 585937500 --exit-duration-in-mins 220 "
    "--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective "
    "--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 4096 "
    "--data-cache-path OUTPUT_PATH/cache --tokenizer-type HuggingFaceTokenizer "
    "--tokenizer-model deepseek-ai/DeepSeek-V3 --data-path DATA_PATH --split 99,1,0 --no-mmap-bin-files "
    "--no-create-attention-mask-in-dataloader "
    "--num-workers 6 --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
    "--kv-channels 128 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000 "
    "--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 584765624 --lr-warmup-samples 1536000 "
    "--lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 "
    "--num-experts 256 --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 8 "
    "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax "
    "--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 "
    "--moe-router-group-topk 4 --moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 "
    "--moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing --q-lora-rank 1536 "
    "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 "
    "--mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 32 "
    "--eval-interval 100 --auto-detect-ckpt-format --load OUTPUT_PATH/checkpoints --save OUTPUT_PATH/checkpoints "
    "--save-interval 100 --dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard "
    "--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard "
    "--log-throughput --log-interval 1 --logging-level 40 --tensorboard-dir OUTPUT_PATH/tensorboard --bf16 "
    "--enable-experimental").split()

# Training flags for the model-only configs (examples/post_training/modelopt/conf: architecture, no training).
TRAINING = ("--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 "
            "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 "
            "--train-iters 3 --global-batch-size 4 --eval-iters 1 --eval-interval 100 --use-distributed-optimizer "
            "--transformer-impl transformer_engine").split()


def _source(tree: str, *path: str) -> str:
    with open(os.path.join(tree, *path)) as f:
        return f.read()


def _mla_fused_yarn(tree: str) -> bool:
    """The release's MLA applies YaRN RoPE through a fusion (0.12's refuses: "MLA Yarn RoPE does not support RoPE
    fusion")."""
    return "fused_apply_mla_rope" in _source(tree, "megatron", "core", "transformer", "multi_latent_attention.py")


def _layernorm_recompute_in_fp8(tree: str) -> bool:
    """The release recomputes layernorms under (non-delayed) FP8 (0.13's config refuses: "moe_act and layernorm
    recompute cannot work with fp8")."""
    config = _source(tree, "megatron", "core", "transformer", "transformer_config.py")
    return "layernorm recompute cannot work with fp8" not in config


def _random_logits_replayed(tree: str) -> bool:
    """--moe-router-force-load-balancing draws its random logits from the RNG tracker, which a recompute of the MoE
    layer (--recompute-modules moe) replays; 0.13 to 0.15 draw from a torch.Generator of their own, so the recompute
    routes otherwise than the forward did (torch.utils.checkpoint: "Recomputed values ... have different
    metadata")."""
    return "RandomSTE.generator" not in _source(tree, "megatron", "core", "transformer", "moe", "moe_utils.py")


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: where its flags come from and how they are shrunk.

    script: a file of the tree (a glob, first match) run under bash, or None for `flags`; args: the script's
    positional arguments; capture: the variable holding the flags (None: what the script hands to torchrun or
    python after pretrain_gpt.py); switches: the script's own environment switches; sizes: values for OVERRIDABLE
    flags (over SMALL, PATHS and ALWAYS; DROP removes the flag; ones the script lacks are added); extra: flags the
    script lacks, added; optional: added where the release's pretrain_gpt.py takes the flag; changes: (flag,
    values or DROP, why) for the few flags beyond OVERRIDABLE that cannot stay as written; needs: (what,
    predicate(tree)) the release must have."""
    id: str
    script: str | None = None
    args: tuple[str, ...] = ()
    capture: str | None = None
    switches: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()
    sizes: tuple[tuple[str, tuple[str, ...] | None], ...] = ()
    extra: tuple[str, ...] = ()
    optional: tuple[tuple[str, ...], ...] = ()
    changes: tuple[tuple[str, tuple[str, ...] | None, str], ...] = ()
    needs: tuple[tuple[str, Callable[[str], bool]], ...] = ()

    @property
    def overrides(self) -> dict[str, tuple[str, ...] | None]:
        sizes = dict(self.sizes)
        unknown = set(sizes) - set(OVERRIDABLE)
        assert not unknown, f"{self.id}: {sorted(unknown)} are not in OVERRIDABLE"
        changed = {flag: values for flag, values, _ in self.changes}
        return {**SMALL, **PATHS, **ALWAYS, **sizes, **changed}

    @property
    def changeable(self) -> set[str]:
        """The flags this case may change."""
        return set(OVERRIDABLE) | {flag for flag, _, _ in self.changes}


MOCK = "MOCK"  # the llama script's word for mock data and tokenizer
DEEPSEEK_V3_SIZES = (
    ("--expert-model-parallel-size", ("2",)), ("--num-experts", ("8",)),
    ("--moe-layer-freq", ("[0]*1+[1]*1",)),  # as DeepSeek-V3: dense layers first, then MoE layers
    ("--moe-router-topk", ("4",)), ("--moe-router-num-groups", ("4",)), ("--moe-router-group-topk", ("2",)),
    ("--q-lora-rank", ("48",)), ("--kv-lora-rank", ("32",)), ("--qk-head-dim", ("16",)),
    ("--qk-pos-emb-head-dim", ("8",)), ("--v-head-dim", ("16",)))
DEEPSEEK_V3_CHANGES = (
    ("--moe-token-dispatcher-type", ("alltoall",), "the flex dispatcher runs DeepEP/HybridEP's CUDA kernels"),
    ("--moe-flex-dispatcher-backend", DROP, "no flex dispatcher"))
DEEPSEEK_V3_NEEDS = (
    ("MLA's fused YaRN RoPE", _mla_fused_yarn),
    ("random router logits (--moe-router-force-load-balancing) that a MoE recompute replays", _random_logits_replayed))
# The recipe itself, where a tree has it (read, not run: `DEEPSEEK_V3` is what runs)
DEEPSEEK_V3_RECIPE = Case(
    "deepseek-v3-recipe", "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", capture="PRETRAIN_ARGS",
    switches=(("USE_MEGATRON_FSDP", "0"), ("WANDB", "0"), ("PROFILE", "0"), ("OUTPUT_PATH", "OUTPUT_PATH"),
              ("DATA_PATH", "DATA_PATH")))
CASES = (
    Case("llama3-8b-fp8", "examples/llama/train_llama3_8b_h100_fp8.sh",
         args=("{tmp}/checkpoints", "{tmp}/tensorboard", MOCK, MOCK)),
    Case("mixtral-8x7b", "examples/mixtral/train_mixtral_8x7b_distributed.sh",
         args=("{tmp}/checkpoints", "TOKENIZER_MODEL", "DATA_PATH"),
         sizes=(("--pipeline-model-parallel-size", ("1",)), ("--expert-model-parallel-size", ("2",)))),
    Case("mixtral-8x7b-fused-moe", "examples/mixtral/train_mixtral_8x7b_distributed.sh",
         args=("{tmp}/checkpoints", "TOKENIZER_MODEL", "DATA_PATH"),
         sizes=(("--pipeline-model-parallel-size", ("1",)), ("--expert-model-parallel-size", ("2",))),
         extra=("--moe-permute-fusion", "--moe-router-fusion")),
    # 30 iterations: fp16 starts at a loss scale of 2^32 and skips iterations (no loss logged) while it backs off
    Case("gpt3-175b-fp16-pp2", "examples/gpt3/train_gpt3_175b_distributed.sh",
         args=("{tmp}/checkpoints", "{tmp}/tensorboard", "VOCAB_FILE", "MERGE_FILE", "DATA_PATH"),
         sizes=(("--num-layers", ("4",)), ("--train-iters", ("30",)), ("--tensor-model-parallel-size", ("1",)),
                ("--pipeline-model-parallel-size", ("2",)))),
    Case("deepseek-v3-hif8-delayed", flags=tuple(DEEPSEEK_V3), sizes=DEEPSEEK_V3_SIZES,
         changes=(*DEEPSEEK_V3_CHANGES,
                  ("--recompute-modules", ("mlp", "moe", "mla_up_proj"),
                   "Megatron refuses layernorm (and moe_act) recompute under delayed scaling, which hif8_delayed is "
                   "to Megatron: 'Delayed scaling does not support moe_act and layernorm recompute for fp8'")),
         extra=("--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed"),
         optional=(("--rope-type", "yarn"),),  # MLA's default, and its only RoPE where the flag is missing
         needs=DEEPSEEK_V3_NEEDS),
    # DeepSeek-V3's own FP8 scheme (1x128 activation, 128x128 weight blocks): the recipe's recompute as written
    Case("deepseek-v3-fp8-blockwise", flags=tuple(DEEPSEEK_V3), sizes=DEEPSEEK_V3_SIZES,
         changes=DEEPSEEK_V3_CHANGES,
         extra=("--fp8-format", "e4m3", "--fp8-recipe", "blockwise"),
         optional=(("--rope-type", "yarn"),),
         needs=(*DEEPSEEK_V3_NEEDS, ("layernorm recompute under FP8", _layernorm_recompute_in_fp8))),
    Case("qwen3-8b-fp8-blockwise-tp2",
         "examples/post_training/modelopt/conf/[qQ]wen/Qwen3-8B.sh", capture="MODEL_ARGS",
         sizes=(("--tensor-model-parallel-size", ("2",)),),
         extra=(*TRAINING, "--sequence-parallel", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise")),
    Case("qwen3-30b-a3b-fp8-mxfp8-tp2-ep2",
         "examples/post_training/modelopt/conf/[qQ]wen/Qwen3-30B-A3B.sh", capture="MODEL_ARGS",
         # attention over TP2 (with the config's --sequence-parallel), the experts over EP2 (expert TP 1)
         sizes=(("--tensor-model-parallel-size", ("2",)), ("--expert-model-parallel-size", ("2",)),
                ("--expert-tensor-parallel-size", ("1",)), ("--num-experts", ("16",))),  # 128 experts, top 8
         extra=(*TRAINING, "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")),
)
CASES_BY_ID = {case.id: case for case in CASES}


def trees() -> list[str]:
    """The Megatron-LM trees of MEGATRON_LM_TREES (several separated by os.pathsep)."""
    return [str(tree) for tree in megatron_matrix.trees()]


def release(tree: str) -> tuple[int, int]:
    """(major, minor) of the tree's megatron-core release."""
    major, minor, _ = megatron_matrix.tree_release(pathlib.Path(tree)).split(".")
    return int(major), int(minor)


def tree_id(tree: str) -> str:
    major, minor = release(tree)
    name = os.path.basename(tree.rstrip(os.sep))
    return name if re.fullmatch(r"\d+\.\d+(\.\d+)?", name) else f"{major}.{minor}-{name}"


def python_path(tree: str) -> str:
    """The tree (after the Python 3.12 shim where its release needs it here), the plugin, then the caller's
    PYTHONPATH (a release's extra dependencies, say)."""
    return os.pathsep.join([megatron_matrix.python_path(pathlib.Path(tree)), ROOT,
                            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def script_path(case: Case, tree: str) -> str | None:
    if case.script is None:
        return None
    found = sorted(glob.glob(os.path.join(tree, case.script)))
    return found[0] if found else None


def missing(case: Case, tree: str) -> str | None:
    """Why `case` cannot run on `tree` judging by its files (None: it can)."""
    if case.script is not None and script_path(case, tree) is None:
        return f"this release has no {case.script}"
    for what, has in case.needs:
        if not has(tree):
            return f"this release has no {what}"
    return None


def script_flags(case: Case, tree: str, tmp: str) -> tuple[list[str], dict[str, str]]:
    """The flags the case's script hands to pretrain_gpt.py, and the environment variables it exports."""
    if case.script is None:
        return list(case.flags), {}
    script = script_path(case, tree)
    capture = (f"printf '%s\\0' ${{{case.capture}[@]}}; _env; exit 0" if case.capture else "exit 4")
    stubs = f"""
_env() {{ printf '%s\\0' __ENV__; env -0; }}
_emit() {{ printf '%s\\0' "$@"; _env; exit 0; }}
torchrun() {{ _emit "$@"; }}; python() {{ _emit "$@"; }}; python3() {{ _emit "$@"; }}
sbatch() {{ {capture}; }}; srun() {{ {capture}; }}; mkdir() {{ :; }}
_script=$1; shift
source "$_script" "$@"
{capture}
"""
    bin_dir = os.path.join(tmp, "script-bin")
    os.makedirs(bin_dir, exist_ok=True)
    for tool in ("dirname", "basename", "env"):
        link = os.path.join(bin_dir, tool)
        if not os.path.exists(link):
            os.symlink(shutil.which(tool), link)
    env = {"PATH": bin_dir, "HOME": tmp, **dict(case.switches)}
    args = [a.format(tmp=tmp) for a in case.args]
    run = subprocess.run([shutil.which("bash"), "-c", stubs, "bash", script, *args], cwd=tree, env=env,
                         capture_output=True, timeout=60)
    assert run.returncode == 0, f"{script} under bash: rc {run.returncode}\n{run.stderr.decode()[-2000:]}"
    words = run.stdout.decode().split("\0")[:-1]
    marker = words.index("__ENV__")
    flags, exported = words[:marker], dict(w.split("=", 1) for w in words[marker + 1:] if "=" in w)
    if case.capture is None:  # the launcher's arguments: the flags follow pretrain_gpt.py
        scripts = [i for i, w in enumerate(flags) if os.path.basename(w) == "pretrain_gpt.py"]
        assert scripts, f"{script} launches no pretrain_gpt.py: {flags}"
        flags = flags[scripts[0] + 1:]
    exported = {k: v for k, v in exported.items() if k not in env and k not in ("PWD", "OLDPWD", "SHLVL", "_")}
    return flags, exported


def is_flag(word: str) -> bool:
    return word.startswith("--")


def groups(flags: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """[(flag, its values)] in order."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for word in flags:
        if is_flag(word):
            out.append((word, ()))
        else:
            assert out, f"a value before any flag: {word!r}"
            out[-1] = (out[-1][0], (*out[-1][1], word))
    return out


def command_flags(case: Case, script: list[str], tmp: str, accepted: set[str] | None = None) -> list[str]:
    """The script's flags with the overrides applied, then the flags the script lacks that the overrides set
    (ALWAYS, case sizes), the case's extra flags and its optional ones (where `accepted`, the release's flags,
    has them; all of them when None)."""
    overrides = {k: None if v is None else tuple(x.format(tmp=tmp) for x in v) for k, v in case.overrides.items()}
    present = {flag for flag, _ in groups(script)}
    absent = {flag for flag, _, _ in case.changes} - present
    assert not absent, f"{case.id}: changes flags the script does not have: {sorted(absent)}"
    out: list[str] = []
    for flag, values in groups(script):
        if flag in overrides:
            if overrides[flag] is not None:
                out += [flag, *overrides[flag]]
        else:
            out += [flag, *values]
    added = {**ALWAYS, **dict(case.sizes)}
    for flag, values in added.items():
        if flag not in present and values is not None:
            out += [flag, *(v.format(tmp=tmp) for v in values)]
    clash = present & {w for w in case.extra if is_flag(w)}
    assert not clash, f"{case.id}: extra flags the script already has: {sorted(clash)}"
    out += list(case.extra)
    for flag, *values in case.optional:
        if accepted is None or flag in accepted:
            out += [flag, *values]
    return out


def kept_flags(case: Case, script: list[str], command: list[str]) -> list[str]:
    """The script's flags (with their values) that the case may not change and that are missing from `command`:
    none, for the flags-unchanged promise."""
    have = groups(command)
    lost = []
    for flag, values in groups(script):
        if flag not in case.changeable and (flag, values) not in have:
            lost.append(" ".join((flag, *values)))
    return lost


# Runs pretrain_gpt.py through mindspeed_te.launch until Megatron parses its arguments, then prints the parser's
# flags (--help cannot list them: 0.18's help text has a bare "%" that argparse's formatting rejects).
_FLAGS_PROBE = """
import argparse, json, sys
from mindspeed_te.launch import main
parse = argparse.ArgumentParser.parse_known_args
def probe(self, *args, **kwargs):
    if "--num-layers" in self._option_string_actions:
        print("\\n" + json.dumps(sorted(self._option_string_actions)))
        raise SystemExit(0)
    return parse(self, *args, **kwargs)
argparse.ArgumentParser.parse_known_args = probe
main(sys.argv[1:])
"""


@functools.cache
def accepted_flags(tree: str) -> frozenset[str]:
    """The flags the release's pretrain_gpt.py takes through mindspeed_te.launch (the plugin's among them)."""
    env = dict(os.environ, PYTHONPATH=python_path(tree), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-c", _FLAGS_PROBE, os.path.join(tree, "pretrain_gpt.py")], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-3000:]
    return frozenset(f for f in json.loads(run.stdout.strip().splitlines()[-1]) if is_flag(f))


def unaccepted(command: list[str], tree: str) -> list[str]:
    accepted = accepted_flags(tree)
    return [flag for flag in dict.fromkeys(w for w in command if is_flag(w)) if flag not in accepted]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Launch:
    command: list[str]
    exported: dict[str, str]
    returncode: int
    output: str
    seconds: float

    def errors(self) -> str:
        """The exceptions the ranks raised, each once."""
        raised = re.findall(r"^(?:\[rank\d+\]: )?((?:[\w.]+\.)?\w*(?:Error|Exception)\b: .*|\S+: error: .*)$",
                            self.output, re.M)
        return "\n".join(dict.fromkeys(line for line in raised if "ChildFailedError" not in line))

    def failure(self) -> str:
        """What a failed run raised, and the last lines its ranks wrote (the traceback)."""
        lines = self.output.splitlines()
        ranks = [line for line in lines if line.startswith("[rank")] or lines
        return (f"rc {self.returncode} after {self.seconds:.0f} s; raised:\n{self.errors()}\n"
                f"---- the ranks' last lines:\n" + "\n".join(ranks[-30:]))

    def losses(self) -> dict[int, dict[str, float]]:
        """{iteration: {loss name: value}} from Megatron's per-iteration log lines (only lines that log losses)."""
        found: dict[int, dict[str, float]] = {}
        for line in self.output.splitlines():
            head = re.search(r"iteration\s+(\d+)/\s*(\d+) \|", line)
            if not head:
                continue
            named = re.findall(r"\| ([\w ]*?loss): ([-+0-9.eEnaifNAIF]+) ", line + " ")
            losses = {name.strip(): float(value) for name, value in named}
            if losses:
                found[int(head.group(1))] = losses
        return found


def prepare(case: Case, tree: str, tmp: str, accepted: frozenset[str] | None = None
            ) -> tuple[list[str], list[str], dict[str, str]]:
    """(the script's flags, the command's flags, the script's exported environment); `accepted`: the release's
    flags (accepted_flags), for the case's optional ones (all of them when None)."""
    script, exported = script_flags(case, tree, tmp)
    return script, command_flags(case, script, tmp, accepted), exported


def launch(case: Case, tree: str, tmp: str, flags: list[str], exported: dict[str, str],
           timeout: float = 840) -> Launch:
    """pretrain_gpt.py of `tree` on 2 processes through torch.distributed.run and mindspeed_te.launch."""
    port = free_port()
    env = dict(os.environ, **exported, **megatron_matrix.helpers_env(), PYTHONPATH=python_path(tree),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("MEGATRON_LM_PATH", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
               "-m", "mindspeed_te.launch", os.path.join(tree, "pretrain_gpt.py"), *flags]
    start = time.monotonic()
    run = subprocess.run(command, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout)
    return Launch(command, exported, run.returncode, run.stdout, time.monotonic() - start)


def main(argv: list[str]) -> int:
    tree, case_id, *rest = argv
    case = CASES_BY_ID[case_id]
    tree = os.path.abspath(tree)
    why = missing(case, tree)
    if why:
        print(f"skip: {why}")
        return 0
    tmp = tempfile.mkdtemp(prefix=f"mlm-{case.id}-")
    script, flags, exported = prepare(case, tree, tmp, accepted_flags(tree))
    print("script flags:", " ".join(script))
    print("exported:", exported)
    print("lost flags:", kept_flags(case, script, flags))
    print("not accepted:", unaccepted(flags, tree))
    print("PYTHONPATH=" + python_path(tree), "torchrun --nproc-per-node=2 -m mindspeed_te.launch",
          os.path.join(tree, "pretrain_gpt.py"), " ".join(flags))
    if "--print" in rest:
        return 0
    megatron_matrix.build_dataset_helpers(tree)
    run = launch(case, tree, tmp, flags, exported)
    print(run.output)
    print(f"rc {run.returncode}, {run.seconds:.0f} s, losses {run.losses()}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
