"""patches/optimizer.py: Megatron's distributed optimizer over torch Adam (no Apex, no TE) saved through
Megatron's distributed checkpointing and resumed on two gloo ranks ends where the uninterrupted run ends,
bit for bit; without the patch the load fails (`assert len(steps) == 1`) or restarts Adam's step at 0."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dist_utils import run_distributed  # noqa: E402

VOCAB, SEQ, STEPS, SAVE_AT = 64, 16, 4, 2
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # what Megatron's training writes by default
DP_RESHARDABLE = hasattr(importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer,
                         "load_parameter_state_from_dp_reshardable")  # that format: 0.15 on


def _build(init_seed: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(init_seed)
    model_parallel_cuda_manual_seed(init_seed)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, use_distributed_optimizer=True), [model])
    return model, optimizer


def _train_step(model, optimizer, step: int, rank: int) -> None:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 * step + rank))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, position_ids, None, labels=tokens.roll(-1, dims=1)).mean()
    loss.backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]  # the update was applied


def _optimizer_state(optimizer, model_sd, is_loading: bool = False):
    """The optimizer's sharded state in the format Megatron's training writes by default: dp_reshardable where
    the release takes sharding metadata (0.15 on), else the release's own default."""
    if DP_RESHARDABLE:
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=METADATA)
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading)


def _save(model, optimizer, directory: str) -> None:
    from megatron.core import dist_checkpointing

    model_sd = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": _optimizer_state(optimizer, model_sd)}, directory)


def _load(model, optimizer, directory: str) -> None:
    from megatron.core import dist_checkpointing

    model_sd = model.module.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": _optimizer_state(optimizer, model_sd, is_loading=True)}, directory)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])


def _worker(rank: int, world: int, directory: str, patched: bool) -> dict:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.library_compat import register_library_compat
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.optimizer import register_optimizer
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    register_device_cpu(registry)
    register_library_compat(registry)  # (older releases' checkpoint code on NumPy 2 / torch 2.7+)
    if patched:
        register_optimizer(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(1, 1)

    model, optimizer = _build(init_seed=1)
    for step in range(STEPS):
        if step == SAVE_AT:
            _save(model, optimizer, directory)
        _train_step(model, optimizer, step, rank)
    straight = {name: p.detach().clone() for name, p in model.named_parameters()}

    model, optimizer = _build(init_seed=2)  # other weights: everything must come from the checkpoint
    try:
        _load(model, optimizer, directory)
        for step in range(SAVE_AT, STEPS):
            _train_step(model, optimizer, step, rank)
    except AssertionError as error:
        return {"error": f"AssertionError {error}"}
    steps = {float(s["step"]) for s in optimizer.chained_optimizers[0].optimizer.state.values()}
    resumed = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"straight": straight, "resumed": resumed, "steps": steps}


@pytest.mark.slow
def test_distributed_optimizer_resumes_exactly(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), True)
    for result in results:
        assert "error" not in result, result
        assert result["steps"] == {float(STEPS)}  # Adam's own step, one per parameter, advanced from the save's
        assert result["straight"].keys() == result["resumed"].keys()
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), name


@pytest.mark.slow
def test_without_the_patch_megatron_cannot_load_before_a_first_step(tmp_path):
    """The independent check that the test above exercises the patched path: Megatron alone fails (on its load
    before a first step; 0.15 already on its save, at torch Adam's 0-dim step)."""
    try:
        results = run_distributed(_worker, 2, str(tmp_path), False)
    except torch.multiprocessing.ProcessRaisedException as error:
        assert "AssertionError" in str(error), error
        return
    assert all("error" in result for result in results), results
