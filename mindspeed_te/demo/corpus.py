"""The demo's corpus: the bytes of the Python standard library's own source, which every Python installation
carries, so the demo downloads nothing. Tokens are bytes (vocabulary 256). The file list is sorted and the
batches come from a seeded generator, so every run of the demo sees the same data in the same order."""
from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

VOCAB_SIZE = 256


@dataclass
class Corpus:
    train: torch.Tensor  # int64 byte tokens of the training files, concatenated
    val: torch.Tensor  # the held-out files
    train_files: list[str]
    val_files: list[str]


def stdlib_files(directory: Optional[str] = None) -> list[Path]:
    """The top-level `*.py` modules of the standard library (non-empty ones), sorted by name."""
    root = Path(directory or sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.glob("*.py") if f.stat().st_size)
    if not files:
        raise FileNotFoundError(f"no Python source files under {root} (the standard library's directory)")
    return files


def split_files(directory: Optional[str] = None, val_every: int = 10) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every `val_every`-th file by sorted name is held out, so the model
    is scored on modules it never saw, not on other windows of the files it trained on."""
    if val_every < 2:
        raise ValueError(f"val_every must be at least 2, got {val_every}")
    files = stdlib_files(directory)
    held_out = [f for i, f in enumerate(files) if i % val_every == val_every - 1]
    return [f for f in files if f not in held_out], held_out


def load_corpus(directory: Optional[str] = None, val_every: int = 10) -> Corpus:
    train, held_out = split_files(directory, val_every)
    return Corpus(_tokens(train), _tokens(held_out), [f.name for f in train], [f.name for f in held_out])


def _tokens(files: list[Path]) -> torch.Tensor:
    data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy (nats) of the byte frequencies: the loss of the best model that ignores context. A language
    model has learned something beyond byte frequencies once its loss is below this."""
    p = torch.bincount(tokens, minlength=VOCAB_SIZE).double() / tokens.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum()) if p.numel() > 1 else 0.0


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of shape (len(starts), seq_length); labels are the inputs shifted by one byte."""
    rows = tokens[starts[:, None] + torch.arange(seq_length + 1)]
    return rows[:, :-1], rows[:, 1:]


def train_batches(tokens: torch.Tensor, steps: int, batch_size: int, seq_length: int, seed: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of random windows, the same ones in the same order for the same seed."""
    if tokens.numel() <= seq_length + 1:
        raise ValueError(f"the corpus ({tokens.numel()} bytes) is shorter than --seq-length {seq_length} + 1")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield _windows(tokens, torch.randint(0, tokens.numel() - seq_length - 1, (batch_size,),
                                             generator=generator), seq_length)


def val_batches(tokens: torch.Tensor, batches: int, batch_size: int, seq_length: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced windows over the held-out bytes, a fixed validation set."""
    count = batches * batch_size
    starts = torch.linspace(0, tokens.numel() - seq_length - 1, count).long()
    return [_windows(tokens, chunk, seq_length) for chunk in starts.split(batch_size)]


def write_indexed_dataset(prefix: str, directory: Optional[str] = None) -> str:
    """The same corpus as Megatron's indexed dataset (`prefix`.bin / .idx, the files tools/preprocess_data.py
    writes), one document per module, byte tokens stored as uint16 (preprocess_data's choice for a vocabulary
    this small). The training files come first, then the held-out ones; returns the `--split` value that
    gives Megatron exactly those documents for training and validation."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    train, held_out = split_files(directory)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    for f in train + held_out:
        data = f.read_bytes()
        builder.add_document(numpy.frombuffer(data, dtype=numpy.uint8), [len(data)])
    builder.finalize(get_idx_path(prefix))
    return f"{len(train)},{len(held_out)},0"


if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")  # megatron-core's import notes
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m mindspeed_te.demo.corpus PREFIX  (writes PREFIX.bin and PREFIX.idx, "
                         "prints the --split value for Megatron)")
    print(write_indexed_dataset(sys.argv[1]))
