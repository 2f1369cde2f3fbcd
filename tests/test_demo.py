"""The demo (python -m mindspeed_te.demo) and its corpus: closed-form entropies, a held-out split by file,
Megatron's own reader on the indexed dataset we write, and a few steps of every run on a tiny GPT."""
from __future__ import annotations

import csv
import math
import subprocess
import sys
import warnings

import pytest
import torch

from mindspeed_te.demo.corpus import load_corpus, split_files, train_batches, unigram_entropy, val_batches
from mindspeed_te.demo.train import OPT_IN, RUNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def source_dir(tmp_path):
    """Twelve small 'modules' (and an empty one, which is skipped)."""
    for i in range(12):
        (tmp_path / f"mod{i:02d}.py").write_bytes(f"# module {i}\nx = {i}\n".encode() * (i + 1))
    (tmp_path / "empty.py").write_bytes(b"")
    return tmp_path


def test_unigram_entropy_closed_form():
    assert unigram_entropy(torch.arange(256)) == pytest.approx(math.log(256))
    assert unigram_entropy(torch.tensor([7, 7, 9, 9])) == pytest.approx(math.log(2))
    assert unigram_entropy(torch.tensor([1, 1, 1])) == 0.0
    # p = (1/2, 1/4, 1/4): H = 1.5 bits
    assert unigram_entropy(torch.tensor([0, 0, 1, 2])) == pytest.approx(1.5 * math.log(2))


def test_every_tenth_file_is_held_out(source_dir):
    train, held_out = split_files(str(source_dir))
    assert [f.name for f in held_out] == ["mod09.py"]
    assert [f.name for f in train] == [f"mod{i:02d}.py" for i in range(12) if i != 9]
    corpus = load_corpus(str(source_dir))
    assert bytes(corpus.val.tolist()) == (source_dir / "mod09.py").read_bytes()
    assert bytes(corpus.train.tolist()) == b"".join(f.read_bytes() for f in train)
    with pytest.raises(ValueError, match="val_every"):
        split_files(str(source_dir), val_every=1)


def test_batches_are_shifted_windows_in_a_fixed_order():
    tokens = torch.arange(1000)
    first = list(train_batches(tokens, 3, 4, 16, seed=5))
    again = list(train_batches(tokens, 3, 4, 16, seed=5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    for inputs, labels in first:
        assert inputs.shape == labels.shape == (4, 16)
        assert torch.equal(labels, inputs + 1)  # the next byte (tokens are consecutive integers here)
    (inputs, labels), = val_batches(tokens, 1, 2, 16)
    assert inputs[0, 0] == 0 and labels[-1, -1] == 999  # evenly spaced over the whole held-out text


def test_megatron_reads_the_indexed_dataset_we_write(source_dir, tmp_path):
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    pytest.importorskip("megatron.core")
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from mindspeed_te.demo.corpus import write_indexed_dataset

    split = write_indexed_dataset(str(tmp_path / "data" / "stdlib"), str(source_dir))
    dataset = IndexedDataset(str(tmp_path / "data" / "stdlib"))
    train, held_out = split_files(str(source_dir))
    documents = [bytes(dataset[i].astype("uint8").tolist()) for i in range(len(dataset))]
    assert documents == [f.read_bytes() for f in train + held_out]
    # Megatron's document boundaries for this --split: round(fraction * documents) = the held-out files exactly
    fractions = parse_and_normalize_split(split)
    assert round(fractions[0] * len(documents)) == len(train)
    assert round((fractions[0] + fractions[1]) * len(documents)) == len(documents)


def _read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # a subprocess that imports megatron-core and builds thirteen models (~25 s on an idle machine)
def test_demo_trains_every_run_and_writes_its_outputs(tmp_path):
    """A few steps of a tiny GPT per run: each run's loss falls below the uniform model's ln 256, validation
    improves, all runs start from the same weights and batches, and the figures and tables are written."""
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "mindspeed_te.demo", "--out", str(out), "--steps", "8",
                    "--eval-interval", "4", "--eval-batches", "1", "--hidden", "64", "--seq-length", "64",
                    "--batch-size", "4"], check=True, capture_output=True, text=True)
    summary = {row["run"]: row for row in _read_csv(out / "summary.csv")}
    default = [name for name in RUNS if name not in OPT_IN]
    assert list(summary) == default
    losses = _read_csv(out / "losses.csv")
    first_loss = {}
    for run in default:
        train = [float(r["train_loss"]) for r in losses if r["run"] == run]
        val = [float(r["val_loss"]) for r in losses if r["run"] == run and r["val_loss"]]
        assert len(train) == 8 and len(val) == 2
        assert train[-1] < train[0] and max(train[-3:]) < math.log(256), run
        assert val[1] < val[0] < math.log(256), run
        assert float(summary[run]["val_loss"]) == val[-1]
        first_loss[run] = train[0]
    # Same initial weights and first batch: the first losses differ only by FP8 / FP4 rounding.
    for run, loss in first_loss.items():
        assert loss == pytest.approx(first_loss["bf16"], rel=1e-2), run
    assert float(summary["bf16"]["val_loss_minus_bf16"]) == 0.0
    for name in ("demo_loss.png", "demo_numerics.png", "numerics/numerics_sqnr_db.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    # The numerics report covers every TE linear of the two layers and each quantized operand.
    rows = _read_csv(out / "numerics" / "numerics.csv")
    layers = {r["layer"] for r in rows}
    assert layers == {f"decoder.layers.{i}.{m}" for i in range(2) for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    assert {r["tensor"] for r in rows} == {"input", "weight", "grad_output"}
    assert {r["format"] for r in rows if r["format"].startswith("recipe")} == {"recipe:hif8"}
    assert {r["format"] for r in rows} >= {"hif8", "e4m3", "mxfp8", "nvfp4", "mxfp4"}  # the counterfactuals
    # The memory table (issue 33): bf16 training keeps 2 + 4 + 4 + 8 bytes per parameter (weight, fp32 main grad,
    # master, two moments); activation offload leaves a GPT layer a small fraction of its bf16 bytes, and FP8
    # attention at most 0.55x of them.
    memory = {r["what"]: r["figure"] for r in _read_csv(out / "memory.csv")}
    assert memory["bytes per parameter, bf16 weights + fp32 grads, master, moments"] == "18.00"

    def ratio(label: str) -> float:
        return float(memory[f"activation MiB per GPT layer, {label}"].split("(")[1].split("x")[0])

    assert ratio("mxfp8 + cpu offload") < 0.15
    assert ratio("mxfp8 + fp8 attention (current scaling)") <= 0.55 < ratio("mxfp8, bf16 attention")


@pytest.mark.parametrize("argv,flag", [(["--runs", "bf16,fp4"], "--runs"), (["--hidden", "100"], "--hidden"),
                                       (["--numerics-run", "bf16"], "--numerics-run"), (["--steps", "0"], "--steps")])
def test_bad_arguments_are_refused_with_the_flag_named(argv, flag, capsys):
    from mindspeed_te.demo.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert flag in capsys.readouterr().err
