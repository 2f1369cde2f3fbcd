"""The demo's runs: a GPT built from megatron-core (GPTModel, Megatron's TransformerEngine layer spec, patched
so that the TE* classes are mindspeed_te's) learns the bytes of the Python standard library, in bf16, in
every FP8/HiF8 recipe, two recipes again with 8-bit Adam moments, and in NVFP4 and MXFP4 with and without
their stabilisers, from the same initial weights and the same batches.

    python -m mindspeed_te.demo [--out demo_out] [--steps 150] [--runs bf16,hif8-delayed,...] [--seeds N]

Prints a table (final train and validation loss, the difference to bf16, time per step) and writes to --out:
demo_loss.png (train and validation loss curves), demo_numerics.png (per-layer numerics of one run, from
mindspeed_te.debug), summary.csv, losses.csv and the numerics report (numerics/). With --seeds N, every run
is trained with N seeds, and the run-to-run noise of the validation loss is printed and written to seeds.csv.
"""
from __future__ import annotations

import argparse
import csv
import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Optional
from unittest import mock

import torch

from mindspeed_te.demo.corpus import VOCAB_SIZE, load_corpus, train_batches, unigram_entropy, val_batches
from mindspeed_te.demo.memory import memory_rows, write_memory
from mindspeed_te.demo.plots import combine_heatmaps, plot_losses
from mindspeed_te.demo.seeds import format_noise, noise, write_seeds_csv
from mindspeed_te.patches.precision_optimizer import QUANT_STATES
from mindspeed_te.recipe import NVFP4_DISABLE_SWITCHES
from mindspeed_te.state import FP8GlobalStateManager

# The --mxfp4-* options that are stabilisers (MXFP4BlockScaling's random_hadamard_transform, stochastic_rounding)
MXFP4_STABILISERS = ("mxfp4_random_hadamard_transform", "mxfp4_stochastic_rounding")


@dataclass(frozen=True)
class Run:
    """One run, as Megatron's flags name it. Every run has bf16 parameters and fp32 main weights."""
    fp8_format: Optional[str] = None  # --fp8-format; None with no fp4_recipe: the bf16 baseline
    fp8_recipe: Optional[str] = None  # --fp8-recipe
    # --quant-states: Adam moments in 8 bits (--use-precision-aware-optimizer --exp-avg-dtype fp8
    # --exp-avg-sq-dtype fp8) in this format; None: fp32 moments
    quant_states: Optional[str] = None
    fp4_recipe: Optional[str] = None  # --fp4-format e2m1 --fp4-recipe nvfp4|mxfp4
    mxfp4_options: tuple[str, ...] = ()  # the --mxfp4-* flags given, by their config fields (MXFP4_OPTIONS)
    nvfp4_disabled: tuple[str, ...] = ()  # TE's variables set to 1 for the run (NVFP4_DISABLE_SWITCHES)

    def __post_init__(self) -> None:
        """The checks that need no Megatron import; build() checks the names of fp4_recipe and mxfp4_options."""
        if self.quant_states is not None and self.quant_states not in QUANT_STATES:
            raise ValueError(f"Run: quant_states={self.quant_states!r}; allowed: None, {', '.join(QUANT_STATES)}")
        if self.fp4_recipe is not None and self.fp8_format is not None:
            raise ValueError("Run: fp4_recipe and fp8_format cannot be used together (--fp4-format, --fp8-format)")
        if self.mxfp4_options and self.fp4_recipe != "mxfp4":
            raise ValueError(f"Run: mxfp4_options={self.mxfp4_options!r} need fp4_recipe='mxfp4'")
        if self.nvfp4_disabled and (self.fp4_recipe != "nvfp4"
                                    or not set(self.nvfp4_disabled) <= set(NVFP4_DISABLE_SWITCHES)):
            raise ValueError(f"Run: nvfp4_disabled={self.nvfp4_disabled!r} needs fp4_recipe='nvfp4'; allowed: "
                             f"{', '.join(NVFP4_DISABLE_SWITCHES)}")

    @property
    def quantized(self) -> bool:
        return self.fp8_format is not None or self.fp4_recipe is not None

    def stabilised(self) -> Run:
        """This run with its FP4 recipe's stabilisers on: NVFP4 with TE's defaults (none disabled), MXFP4 with
        the Hadamard transform and stochastic rounding (unless it has FP8 activations, which refuse them)."""
        if self.fp4_recipe == "nvfp4":
            return replace(self, nvfp4_disabled=())
        if self.fp4_recipe == "mxfp4" and "mxfp4_fp8_activations" not in self.mxfp4_options:
            return replace(self, mxfp4_options=MXFP4_STABILISERS)
        return self


RUNS: dict[str, Run] = {
    "bf16": Run(),
    "hif8-delayed": Run("hif8", "delayed"),
    "hif8-tensorwise": Run("hif8", "tensorwise"),
    "e4m3-tensorwise": Run("e4m3", "tensorwise"),
    "hybrid-delayed": Run("hybrid", "delayed"),
    "e4m3-blockwise": Run("e4m3", "blockwise"),
    "e4m3-mxfp8": Run("e4m3", "mxfp8"),
    "hif8-delayed+hif8-moments": Run("hif8", "delayed", quant_states="hif8"),
    "e4m3-mxfp8+mxfp8-moments": Run("e4m3", "mxfp8", quant_states="mxfp8"),
    "nvfp4": Run(fp4_recipe="nvfp4"),  # TE's defaults: its three stabilisers on
    "nvfp4-no-stabilisers": Run(fp4_recipe="nvfp4", nvfp4_disabled=NVFP4_DISABLE_SWITCHES),
    "mxfp4+rht+sr": Run(fp4_recipe="mxfp4", mxfp4_options=MXFP4_STABILISERS),
    "mxfp4": Run(fp4_recipe="mxfp4"),
    "mxfp4-fp8-activations": Run(fp4_recipe="mxfp4", mxfp4_options=("mxfp4_fp8_activations",)),
    # one stabiliser off (NVFP4) or on (MXFP4) at a time: what each buys
    "nvfp4-no-rht": Run(fp4_recipe="nvfp4", nvfp4_disabled=("NVTE_NVFP4_DISABLE_RHT",)),
    "nvfp4-no-sr": Run(fp4_recipe="nvfp4", nvfp4_disabled=("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",)),
    "nvfp4-no-2d": Run(fp4_recipe="nvfp4", nvfp4_disabled=("NVTE_NVFP4_DISABLE_2D_QUANTIZATION",)),
    "mxfp4+rht": Run(fp4_recipe="mxfp4", mxfp4_options=("mxfp4_random_hadamard_transform",)),
    "mxfp4+sr": Run(fp4_recipe="mxfp4", mxfp4_options=("mxfp4_stochastic_rounding",)),
}
# Runs only --runs selects, the one-stabiliser ablations: the CPU emulation of FP4 with its stabilisers is
# several times slower than FP8's, and the default runs already take each FP4 recipe with and without them
OPT_IN = ("nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d", "mxfp4+rht", "mxfp4+sr")


def base_run(name: str) -> str:
    """The run that `name` repeats with one change, fp32 moments or its FP4 stabilisers on (itself if none)."""
    base = replace(RUNS[name], quant_states=None).stabilised()
    return next(other for other, run in RUNS.items() if run == base)


@dataclass
class RunResult:
    name: str
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    seconds_per_step: float = 0.0


def setup_megatron() -> None:
    """Patch Megatron as `mindspeed_te.megatron_adaptor` does, and give megatron-core's parallel_state its
    one-rank gloo group with model parallel size 1."""
    import torch.distributed as dist

    # megatron-core's notes about optional packages and its own defaults, printed at import and config time
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|full scope is deprecated).*")
    # torch's note on the collectives Megatron's distributed optimizer calls (runs with 8-bit moments)
    warnings.filterwarnings("ignore", message=".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*")
    from megatron.core import parallel_state

    import mindspeed_te.megatron_adaptor  # noqa: F401  (applies the patch registry)

    # On the CPU, Megatron's "CUDA" RNG stream is the CPU one; its check for the two mixing is noise here.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def build(args: argparse.Namespace, run: Run, seed: int):
    """GPT + Megatron's DDP (fp32 gradient buffers) + its mixed-precision Adam (fp32 main weights) + its
    learning-rate schedule (linear warm-up, cosine decay), seeded identically for every run of one seed.
    FP4 runs set the config's fp4 / fp4_recipe and the fields the --mxfp4-* flags set.
    8-bit moments take Megatron's own path: its precision-aware optimizer (which needs its distributed
    optimizer, here over one rank) with TE's FusedAdam, served by mindspeed_te's through the patch registry."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te import FP8GlobalStateManager
    from mindspeed_te.megatron.fp4 import MXFP4_OPTIONS, make_fp4_recipe

    FP8GlobalStateManager.reset()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 32,
                               bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                               fp8=run.fp8_format, fp8_recipe=run.fp8_recipe or "delayed",
                               fp4="e2m1" if run.fp4_recipe else None, fp4_recipe=run.fp4_recipe or "nvfp4")
    if run.fp4_recipe:
        unknown = sorted(set(run.mxfp4_options) - set(MXFP4_OPTIONS))
        if unknown:
            raise ValueError(f"Run: mxfp4_options {unknown}; allowed: {', '.join(MXFP4_OPTIONS)}")
        for dest in MXFP4_OPTIONS:  # where the --mxfp4-* flags put them (patches/arguments)
            setattr(config, dest, dest in run.mxfp4_options)
        make_fp4_recipe(run.fp4_recipe, config)  # a bad recipe or combination fails here, not in the first step
    gpt = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=VOCAB_SIZE,
                   max_sequence_length=args.seq_length, position_embedding_type="rope")
    low_precision = run.quant_states is not None
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=low_precision),
        Float16Module(config, gpt))
    config.finalize_model_grads_func = finalize_model_grads  # as Megatron's training loop sets them
    moments = torch.uint8 if low_precision else torch.float32  # --exp-avg-dtype / --exp-avg-sq-dtype fp8
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.lr / 10, weight_decay=0.1, clip_grad=1.0, bf16=True,
        use_distributed_optimizer=low_precision, use_precision_aware_optimizer=low_precision,
        exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    if low_precision:
        optimizer_config.quant_states = run.quant_states  # where --quant-states puts it (patches/precision_optimizer)
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    warmup = max(1, args.steps // 10)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
                                        lr_warmup_steps=warmup, lr_decay_steps=args.steps, lr_decay_style="cosine",
                                        start_wd=0.1, end_wd=0.1, wd_incr_steps=args.steps, wd_incr_style="constant")
    return gpt, model, optimizer, scheduler


def _forward_step(data_iterator, model: torch.nn.Module):
    """Megatron's forward-step contract: the output and a function that turns it into the loss."""
    inputs, labels = next(data_iterator)
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    per_token = model(inputs, positions, None, labels=labels)  # the layer spec's causal mask; no mask tensor

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # a copy: the schedule divides `loss` in place
    return per_token, loss_func


def _run_schedule(model: torch.nn.Module, batches: list, forward_only: bool) -> float:
    """One step (or one validation pass) through Megatron's no-pipelining schedule, one micro-batch per
    batch; it also marks each step's first micro-batch, so that FP8 weights are quantized afresh."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch_size, seq_length = batches[0][0].shape
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
        seq_length=seq_length, micro_batch_size=batch_size, forward_only=forward_only)
    return sum(float(x["lm loss"]) for x in losses) / len(losses)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    loss = _run_schedule(model, batches, forward_only=True)
    model.train()
    return loss


@contextmanager
def nvfp4_switches(run: Run) -> Iterator[None]:
    """TE's NVFP4 switches as the run sets them (its nvfp4_disabled 1, the others unset), for the whole run:
    Megatron's FP4 autocast makes the recipe, which reads them, at every forward. Restored afterwards."""
    with mock.patch.dict(os.environ):
        for switch in NVFP4_DISABLE_SWITCHES:
            os.environ.pop(switch, None)
        os.environ.update(dict.fromkeys(run.nvfp4_disabled, "1"))
        yield


def train(name: str, args: argparse.Namespace, corpus, val, seed: int, report=None) -> RunResult:
    """One run: args.steps steps on the batches of `seed` from the weights of `seed`, validation every
    args.eval_interval steps and at the end. With `report` (a mindspeed_te.debug.NumericsReport), the last
    step's numerics are recorded."""
    with nvfp4_switches(RUNS[name]):
        return _train(name, args, corpus, val, seed, report)


def _train(name: str, args: argparse.Namespace, corpus, val, seed: int, report) -> RunResult:
    from tqdm import tqdm

    gpt, model, optimizer, scheduler = build(args, RUNS[name], seed)
    if report is not None:
        report.watch(gpt)
    result, busy = RunResult(name), 0.0
    batches = train_batches(corpus.train, args.steps, args.batch_size, args.seq_length, seed)
    desc = f"{name:{max(map(len, RUNS))}s}" + (f" seed {seed}" if args.seeds > 1 else "")
    with tqdm(total=args.steps, desc=desc, unit="step", leave=True) as bar:
        for step, batch in enumerate(batches, start=1):
            start = time.perf_counter()
            if report is not None:
                report.begin_step(step)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            result.train_losses.append(_run_schedule(model, [batch], forward_only=False))
            optimizer.step()
            scheduler.step(increment=1)
            FP8GlobalStateManager.harvest_nonfinite()  # the step's NaN/Inf report, where the host has waited
            if report is not None:
                report.stop()
            busy += time.perf_counter() - start
            if step % args.eval_interval == 0 or step == args.steps:
                result.val_losses.append((step, evaluate(model, val)))
            bar.set_postfix(loss=f"{result.train_losses[-1]:.3f}",
                            val=f"{result.val_losses[-1][1]:.3f}" if result.val_losses else "-")
            bar.update()
    result.seconds_per_step = busy / args.steps
    return result


def final_train_loss(result: RunResult) -> float:
    """The mean of the last 10 steps (one batch's loss is noisy)."""
    tail = result.train_losses[-10:]
    return sum(tail) / len(tail)


def write_csv(results: list[RunResult], out: str) -> list[list]:
    """summary.csv (one row per run) and losses.csv (every step's train loss, validation where measured)."""
    baseline = next((r for r in results if r.name == "bf16"), None)
    table = []
    for r in results:
        val = r.val_losses[-1][1]
        table.append([r.name, final_train_loss(r), val, val - baseline.val_losses[-1][1] if baseline else float("nan"),
                      1000 * r.seconds_per_step])
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "train_loss", "val_loss", "val_loss_minus_bf16", "ms_per_step"])
        writer.writerows(table)
    with open(os.path.join(out, "losses.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", "train_loss", "val_loss"])
        for r in results:
            val = dict(r.val_losses)
            writer.writerows([r.name, step, loss, val.get(step, "")]
                             for step, loss in enumerate(r.train_losses, start=1))
    return table


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_te.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="directory for the figures and CSV files")
    parser.add_argument("--runs", default=",".join(name for name in RUNS if name not in OPT_IN),
                        help=f"comma-separated subset of: {', '.join(RUNS)} (default: all but {', '.join(OPT_IN)})")
    parser.add_argument("--numerics-run", default="hif8-delayed",
                        help="the FP8 or FP4 run whose last step is recorded by the numerics report")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 32 (head size 32)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234, help="the initial weights and the order of the batches")
    parser.add_argument("--seeds", type=int, default=1,
                        help="train every run with N seeds (--seed, --seed + 1, ...) and print the run-to-run noise "
                             "of the validation loss (seeds.csv); the figures and summary.csv show --seed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: the GEMMs are small, and one thread never waits for a "
                             "descheduled partner on a busy machine)")
    args = parser.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in args.runs + [args.numerics_run] if r not in RUNS]
    if unknown or not args.runs:
        parser.error(f"--runs / --numerics-run: unknown run {unknown or '(none given)'}; allowed: {', '.join(RUNS)}")
    if not RUNS[args.numerics_run].quantized:
        parser.error("--numerics-run must name an FP8 or FP4 run (the bf16 run quantizes nothing)")
    for flag in ("steps", "eval_interval", "eval_batches", "layers", "threads", "seeds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    # MXFP8 and MXFP4 quantize 32-element blocks (NVFP4 16) along both dims of every GEMM operand: tokens and
    # hidden sizes (QKV 3x, FFN 4x the hidden size).
    if args.hidden % 32 or args.seq_length * args.batch_size % 32:
        parser.error("--hidden and --seq-length x --batch-size must be multiples of 32")
    return args


def main(argv: Optional[list[str]] = None) -> list[list]:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    setup_megatron()
    from mindspeed_te.debug import NumericsReport

    corpus = load_corpus()
    entropy = unigram_entropy(corpus.train)
    val = val_batches(corpus.val, args.eval_batches, args.batch_size, args.seq_length)
    os.makedirs(args.out, exist_ok=True)
    print(f"corpus: {len(corpus.train_files)} standard-library modules for training ({corpus.train.numel():,} bytes), "
          f"{len(corpus.val_files)} held out ({corpus.val.numel():,} bytes); unigram entropy {entropy:.3f} nats/byte")
    print(f"model: GPT, {args.layers} layers, hidden {args.hidden}, sequence {args.seq_length}, batch "
          f"{args.batch_size}, {args.steps} steps, bf16 parameters\n")
    report = NumericsReport(os.path.join(args.out, "numerics"), interval=args.steps)
    by_seed = {seed: [train(name, args, corpus, val, seed,
                            report if seed == args.seed and name == args.numerics_run else None)
                      for name in args.runs]
               for seed in range(args.seed, args.seed + args.seeds)}
    results = by_seed[args.seed]

    table = write_csv(results, args.out)
    plot_losses(results, entropy, os.path.join(args.out, "demo_loss.png"), base_run)
    heatmaps = [p for p in report.write() if p.endswith(".png")]
    if heatmaps:
        combine_heatmaps(heatmaps, os.path.join(args.out, "demo_numerics.png"))
    width = max(len("run"), *(len(name) for name in args.runs))
    print(f"\n{'run':{width}s} {'train loss':>10s} {'val loss':>9s} {'val - bf16':>10s} {'ms/step':>8s}")
    for name, train_loss, val_loss, diff, ms in table:
        print(f"{name:{width}s} {train_loss:10.4f} {val_loss:9.4f} {diff:+10.4f} {ms:8.0f}")
    if args.seeds > 1:
        write_seeds_csv(by_seed, os.path.join(args.out, "seeds.csv"))
        print(f"\nrun-to-run noise: the final validation loss over seeds {args.seed}..{args.seed + args.seeds - 1}\n"
              + format_noise(noise(by_seed, base_run)))
    memory = memory_rows()
    write_memory(memory, os.path.join(args.out, "memory.csv"))
    width = max(len(what) for what, _ in memory)
    print("\nmemory (python -m mindspeed_te.bench --only memory)")
    for what, figure in memory:
        print(f"{what:{width}s}  {figure}")
    print(f"\n(unigram entropy {entropy:.3f}; figures and CSV files in {args.out}/; "
          f"{time.perf_counter() - started:.0f} s in all)")
    return table

