"""Megatron distributed checkpoints (torch_dist) between a TransformerEngine run and this plugin.

A megatron-core GPT (TE layer spec, served by this plugin's TE* classes; a dense layer and an MoE layer with
grouped experts; delayed scaling, so every linear's `_extra_state` carries amax histories and scales) trains on
two gloo processes under Megatron's schedule, distributed optimizer (Adam) and finalize_model_grads, and is
saved through `dist_checkpointing` twice at the same step: once in TransformerEngine's `_extra_state` format
(MINDSPEED_TE_EXTRA_STATE_FORMAT=te, what --fp8-extra-state-format te sets), standing for a TE run's checkpoint,
and once in this plugin's own. Then, in fresh models with other initial weights:

- TE -> here: the TE-format checkpoint loads with the plugin's default format; every FP8 module's amax histories
  and scales equal the saved ones, and the resumed losses equal the uninterrupted run's, exactly.
- here -> TE: this plugin's checkpoint loads with the te setting, is saved again (in TE's format), and resumes
  with the same losses; the re-saved entries are what TE reads: TE 2.x unpickles them into its own recipe and
  tensors (Megatron's per-expert pieces merged as megatron-core merges them give the module's slots per GEMM),
  and TE 2.18's classification treats them as it treats its own delayed-scaling entries.

Layouts: TP2 + EP2 (expert TP 1, sequence parallel), PP2 (the MoE layer on the second stage), and TP2 + EP2
with FP8 parameters (fp8_model_init, Megatron's --fp8-param-gather), where the test also reads what Megatron's
checkpoint holds for an FP8 weight: its dequantized values in the parameter's nominal dtype, not its codes.
There only the first resumed loss is the uninterrupted run's: Megatron keeps TP rank 0's `_extra_state` only, and
FP8 weights' newest amaxes differ between TP ranks (the last test but one shows exactly that).
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from mindspeed_te.te_extra_state import EXTRA_STATE_FORMAT_ENV  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.test_te_checkpoints import (  # noqa: E402
    TEDelayedScaling,
    delayed_state,
    extra,
    megatron_merge,
    te2_entry,
    te_218_action,
    te_reads,
)

pytestmark = pytest.mark.slow

VOCAB, SEQ, MBS = 64, 16, 2
SAVE_AT, RESUMED = 3, 2  # steps before the save, steps compared after it
HISTORY = 4
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # what Megatron's training writes by default
LAYOUTS = {  # (tensor, pipeline, expert) parallel sizes, FP8 parameters
    "tp2-ep2": (2, 1, 2, False),
    "pp2": (1, 2, 1, False),
    "tp2-ep2-fp8-params": (2, 1, 2, True),
}
FP8_WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"  # a dense FP8 weight whose checkpoint values are read


def _setup(tp: int, pp: int, ep: int):
    from megatron.core import parallel_state

    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.library_compat import register_library_compat
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.optimizer import register_optimizer
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    register_device_cpu(registry)
    register_library_compat(registry)
    register_optimizer(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    return registry


def _build(seed: int, tp: int, pp: int, ep: int, fp8_params: bool):
    """The GPT (this rank's stage) in bf16 under DDP, and Megatron's distributed optimizer; `seed` sets the initial
    weights."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te import FP8GlobalStateManager

    FP8GlobalStateManager.reset()  # as in a fresh process
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
        moe_layer_freq=[0, 1], moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1, sequence_parallel=tp > 1,
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="delayed",
        fp8_amax_history_len=HISTORY, fp8_amax_compute_algo="max", fp8_param=fp8_params)
    gpt = GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=True), vocab_size=VOCAB,
                   max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    Float16Module(config, gpt))  # bf16 training, as Megatron's builds it
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True,
                                                       use_distributed_optimizer=True), [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def _step(model, optimizer, step: int) -> list[float]:
    """One iteration through Megatron's schedule (one micro-batch); the loss on the last stage, [] elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(step))

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        output = module(batch, torch.arange(SEQ).expand(MBS, SEQ), None, labels=batch.roll(-1, dims=1))

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    stored = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
                                         num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS,
                                         forward_only=False)
    assert optimizer.step()[0]
    return [float(item["lm loss"]) for item in stored]


def _gpt(model) -> torch.nn.Module:
    return model.module.module  # DDP(Float16Module(GPTModel))


def _fp8_modules(model) -> dict[str, Any]:
    """The modules with FP8 state (attention has none unless it runs in FP8: fp8_dpa)."""
    from mindspeed_te.modules.base import FP8ModuleBase

    return {name: module for name, module in _gpt(model).named_modules()
            if isinstance(module, FP8ModuleBase) and module.fp8_states is not None}


def _fp8_state(model) -> dict[str, list[torch.Tensor]]:
    """Every FP8 module's forward / backward scales and amax histories, in its own slot layout."""
    return {name: [t.clone() for state in module.fp8_states for t in (state.scale, state.amax_history)]
            for name, module in _fp8_modules(model).items()}


def _te_slots(model) -> dict[str, dict[str, torch.Tensor]]:
    """Every FP8 module's state as TE keeps it (TE's keys, slots GEMM by GEMM)."""
    out = {}
    for name, module in _fp8_modules(model).items():
        fwd, bwd = module.fp8_states
        out[name] = {}
        for key, state, forward in (("fwd", fwd, True), ("bwd", bwd, False)):
            order = torch.argsort(torch.tensor(module.per_gemm_order(forward)))
            out[name][f"scale_{key}"] = state.scale.index_select(0, order)
            out[name][f"amax_history_{key}"] = state.amax_history.index_select(1, order)
    return out


def _optimizer_state(optimizer, model_sd, is_loading: bool = False):
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=METADATA)


def _save(model, optimizer, directory: str, extra_state_format: str) -> None:
    from megatron.core import dist_checkpointing

    os.environ[EXTRA_STATE_FORMAT_ENV] = extra_state_format  # read at every save, as --fp8-extra-state-format does
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory)
    torch.distributed.barrier()
    model_sd = _gpt(model).sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": _optimizer_state(optimizer, model_sd)}, directory)
    os.environ.pop(EXTRA_STATE_FORMAT_ENV)


def _load(model, optimizer, directory: str) -> dict[str, Any]:
    """Load model and optimizer; returns the model's state dict as the checkpoint gave it (before the load)."""
    from megatron.core import dist_checkpointing

    model_sd = _gpt(model).sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": _optimizer_state(optimizer, model_sd, True)},
                                     directory)
    raw = dict(loaded["model"])
    _gpt(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    return raw


def _entries(state: dict[str, Any]) -> dict[str, bytes]:
    return {key: value.numpy().tobytes() for key, value in state.items() if re.search(r"_extra_state\d*$", key)}


def _checkpoint_bytes_name_the_plugin(directory: str) -> bool:
    """Whether any file of a checkpoint names this plugin (a pickled class of it would)."""
    return any(b"mindspeed_te" in open(os.path.join(root, name), "rb").read()
               for root, _, names in os.walk(directory) for name in names)


def _stored_dtype(directory: str, key: str) -> tuple[str, tuple[int, ...]]:
    """The dtype and global shape torch.distributed.checkpoint's metadata records for a tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    entry = FileSystemReader(directory).read_metadata().state_dict_metadata[key]
    return str(entry.properties.dtype), tuple(entry.size)


def _worker(rank: int, world: int, directory: str, layout: str) -> dict:
    warnings.filterwarnings("ignore")
    from mindspeed_te.quantized_tensor import QuantizedTensor

    tp, pp, ep, fp8_params = LAYOUTS[layout]
    registry = _setup(tp, pp, ep)
    te_dir, ours_dir, back_dir = (os.path.join(directory, name) for name in ("te", "ours", "back"))
    steps = range(SAVE_AT, SAVE_AT + RESUMED)

    model, optimizer = _build(1, tp, pp, ep, fp8_params)
    for step in range(SAVE_AT):
        _step(model, optimizer, step)
    _save(model, optimizer, te_dir, "te")  # standing for a TransformerEngine run's checkpoint
    _save(model, optimizer, ours_dir, "mindspeed_te")
    result: dict[str, Any] = {"saved": _fp8_state(model), "saved_slots": _te_slots(model), "fp8_weight": None}
    weight = dict(_gpt(model).named_parameters()).get(FP8_WEIGHT)
    if isinstance(weight, QuantizedTensor):  # what an FP8 weight is at the save
        result["fp8_weight"] = {"type": type(weight).__name__, "dtype": str(weight.dtype),
                                "codes": weight._data.clone(), "dequantized": weight.dequantize().clone(),
                                "stored": _stored_dtype(te_dir, FP8_WEIGHT)}
    result["straight"] = [loss for step in steps for loss in _step(model, optimizer, step)]

    te_model, te_optimizer = _build(2, tp, pp, ep, fp8_params)
    from_te = _load(te_model, te_optimizer, te_dir)  # this plugin's default format
    result["te_to_ours"] = {"entries": _entries(from_te), "loaded": _fp8_state(te_model),
                            "names_plugin": _checkpoint_bytes_name_the_plugin(te_dir)}
    if result["fp8_weight"] is not None:
        loaded_weight = dict(_gpt(te_model).named_parameters())[FP8_WEIGHT]
        result["fp8_weight"].update(checkpoint_value=from_te[FP8_WEIGHT].clone(),
                                    checkpoint_type=type(from_te[FP8_WEIGHT]).__name__,
                                    loaded_type=type(loaded_weight).__name__, loaded_codes=loaded_weight._data.clone())
    result["te_to_ours"]["losses"] = [loss for step in steps for loss in _step(te_model, te_optimizer, step)]

    ours_model, ours_optimizer = _build(3, tp, pp, ep, fp8_params)
    os.environ[EXTRA_STATE_FORMAT_ENV] = "te"  # a run with the te setting loads our checkpoint
    _load(ours_model, ours_optimizer, ours_dir)
    result["ours_to_te"] = {"loaded": _fp8_state(ours_model)}
    _save(ours_model, ours_optimizer, back_dir, "te")
    back_model, back_optimizer = _build(4, tp, pp, ep, fp8_params)
    result["ours_to_te"].update(entries=_entries(_load(back_model, back_optimizer, back_dir)),  # what TE is given
                                back_loaded=_fp8_state(back_model),
                                names_plugin=_checkpoint_bytes_name_the_plugin(back_dir))
    result["ours_to_te"]["losses"] = [loss for step in steps for loss in _step(ours_model, ours_optimizer, step)]

    # The control: the same checkpoint without its FP8 state (scales and histories started fresh) resumes with
    # another first loss, so the losses above depend on that state coming back.
    fresh_model, fresh_optimizer = _build(5, tp, pp, ep, fp8_params)
    _load(fresh_model, fresh_optimizer, ours_dir)
    for module in _fp8_modules(fresh_model).values():
        for state in module.fp8_states:
            state.scale.fill_(1.0)
            state.amax_history.zero_()
    result["fresh_losses"] = _step(fresh_model, fresh_optimizer, SAVE_AT)

    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    registry.revert()
    return result


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> tuple[str, list[dict]]:
    """The two ranks' results of one layout's run (once per layout for the module)."""
    return request.param, run_distributed(_worker, 2, str(tmp_path_factory.mktemp(request.param)), request.param)


ALL_LAYOUTS = pytest.mark.parametrize("runs", list(LAYOUTS), indirect=True)
FP8_PARAMS = pytest.mark.parametrize("runs", [name for name, layout in LAYOUTS.items() if layout[3]], indirect=True)


def _expected(results: list[dict], rank: int, layout: str, key: str) -> dict[str, Any]:
    """What rank `rank` should have loaded: Megatron checkpoints a dense module's `_extra_state` once per tensor-
    parallel group (its replica id counts the TP rank), so every TP rank loads TP rank 0's; each expert's entry
    is its own (sharded by global expert index)."""
    tp0 = rank - rank % LAYOUTS[layout][0]  # megatron-core numbers TP ranks first
    return {name: (results[rank] if ".experts." in name else results[tp0])[key][name]
            for name in results[rank][key]}


def _differing(expected: dict[str, list[torch.Tensor]], loaded: dict[str, list[torch.Tensor]]) -> list[str]:
    assert expected.keys() == loaded.keys()
    return [name for name in expected if not all(torch.equal(a, b) for a, b in zip(expected[name], loaded[name]))]


def _assert_te_entries(entries: dict[str, bytes], saved_slots: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each entry is TE 2.x's: TE unpickles it into its DelayedScaling and tensors, which are the saved slots
    (grouped experts: Megatron's per-expert pieces, merged as megatron-core merges them); TE 2.18 classifies it as
    its own delayed-scaling entries ("unsafe_load": loaded with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1)."""
    te_own = te2_entry({"recipe": TEDelayedScaling(amax_history_len=HISTORY), **delayed_state(1, HISTORY),
                        "extra_fp8_variables": extra(1)}).numpy().tobytes()
    modules: dict[str, list[tuple[int, dict]]] = {}
    for key, raw in entries.items():
        assert te_218_action(raw) == te_218_action(te_own) == "unsafe_load", key
        state = te_reads(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        assert type(state["recipe"]) is TEDelayedScaling, key
        assert state["recipe"].amax_history_len == HISTORY and state["recipe"].amax_compute_algo == "max"
        name, piece = re.fullmatch(r"(.*)\._extra_state(\d*)", key).groups()
        modules.setdefault(name, []).append((int(piece or 0), state))
    assert modules.keys() == saved_slots.keys()
    for name, pieces in modules.items():
        states = [state for _, state in sorted(pieces, key=lambda p: p[0])]
        whole = states[0] if len(states) == 1 else megatron_merge(states)
        if len(states) > 1:
            assert all(s["extra_fp8_variables"]["num_gemms"] == 1 for s in states)
        for key, value in saved_slots[name].items():
            assert torch.equal(whole[key], value), (name, key)


def _assert_resumed(layout: str, losses: list[float], straight: list[float]) -> None:
    """The first resumed loss is the uninterrupted run's; so are the later ones, except with FP8 parameters
    under TP (see test_fp8_parameter_amaxes_of_tp_ranks_above_0_are_not_checkpointed)."""
    assert len(losses) == len(straight)
    if LAYOUTS[layout][3] and LAYOUTS[layout][0] > 1:
        assert losses[:1] == straight[:1]
    else:
        assert losses == straight


@ALL_LAYOUTS
def test_te_checkpoint_resumes_here_exactly(runs):
    """TE -> here: a TE-format torch_dist checkpoint loads with this plugin's default format; amax histories and
    scales are the saved ones, the resumed losses are the uninterrupted run's."""
    layout, results = runs
    for rank, result in enumerate(results):
        run = result["te_to_ours"]
        _assert_te_entries(run["entries"], _expected(results, rank, layout, "saved_slots"))  # TE's format
        assert not run["names_plugin"]  # nothing in the checkpoint needs this plugin to be read
        assert _differing(_expected(results, rank, layout, "saved"), run["loaded"]) == [], (layout, rank)
        _assert_resumed(layout, run["losses"], result["straight"])
        assert result["fresh_losses"][:1] != result["straight"][:1] or not result["straight"]
    assert any(result["straight"] for result in results)  # the last stage reported its losses


@ALL_LAYOUTS
def test_checkpoint_from_here_resumes_with_the_te_setting_and_is_saved_for_te(runs):
    """here -> TE: this plugin's checkpoint loads with the te setting and resumes exactly; saved again, its
    entries are TE's and load back with the same state."""
    layout, results = runs
    for rank, result in enumerate(results):
        run = result["ours_to_te"]
        expected = _expected(results, rank, layout, "saved")
        assert _differing(expected, run["loaded"]) == [] and _differing(expected, run["back_loaded"]) == []
        _assert_te_entries(run["entries"], _expected(results, rank, layout, "saved_slots"))
        assert not run["names_plugin"]
        _assert_resumed(layout, run["losses"], result["straight"])


@FP8_PARAMS
def test_fp8_parameters_are_checkpointed_as_high_precision_values(runs):
    """Megatron's sharded state dict holds the FP8 parameter itself; its torch_dist checkpoint holds the
    dequantized values in the parameter's nominal dtype (megatron-core dequantizes FP8 tensors of the state dict
    it loads into, `force_all_tensors_to_non_fp8`), and loading quantizes them again with the saved scale, which
    gives back the saved codes exactly."""
    _, results = runs
    for result in results:
        weight = result["fp8_weight"]
        assert weight["type"] == "Float8Tensor" and weight["dtype"] == "torch.bfloat16"
        assert weight["stored"] == ("torch.bfloat16", (64, 32))  # fc1's whole weight, TP-split along dim 0
        assert weight["checkpoint_type"] == "Tensor" and weight["checkpoint_value"].dtype == torch.bfloat16
        assert torch.equal(weight["checkpoint_value"], weight["dequantized"])
        assert weight["loaded_type"] == "Float8Tensor" and torch.equal(weight["loaded_codes"], weight["codes"])


@FP8_PARAMS
def test_fp8_parameter_amaxes_of_tp_ranks_above_0_are_not_checkpointed(runs):
    """A limit of Megatron's checkpoints, with TE as here: after each step the optimizer casts an FP8 weight's
    shard and records its amax (reduced over data parallelism only) as the newest row of the weight's amax
    history; tensor-parallel ranks hold different shards, so their rows differ until the next forward's amax
    reduction. Megatron saves a dense module's `_extra_state` from TP rank 0 only, so TP rank 1 resumes with
    rank 0's newest weight amaxes: the first resumed loss is unchanged (the scales agree), later scales can differ.
    Nothing else differs; experts (one entry per expert) keep their own."""
    _, results = runs
    first, second = results[0]["saved"], results[1]["saved"]  # [fwd scale, fwd history, bwd scale, bwd history]
    dense = [name for name in first if ".experts." not in name]
    assert dense
    for name in dense:
        fwd_scale, fwd_history, bwd_scale, bwd_history = zip(first[name], second[name])
        assert all(torch.equal(a, b) for a, b in (fwd_scale, bwd_scale, bwd_history)), name
        differing = {tuple(p) for p in (fwd_history[0] != fwd_history[1]).nonzero().tolist()}
        weight_slots = {(0, 3 * gemm + 1) for gemm in range(fwd_history[0].shape[1] // 3)}
        assert differing and differing <= weight_slots, (name, differing)


def _grouped_without_expert_parallelism(rank: int, world: int) -> dict:
    """Data parallelism 2, expert TP and EP 1: TERowParallelGroupedLinear's forward on this rank's tokens."""
    from megatron.core import parallel_state

    from mindspeed_te.megatron import TERowParallelGroupedLinear
    from tests.test_megatron_linear import _config, _init

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    fc2 = TERowParallelGroupedLinear(2, 32, 16, config=_config(num_moe_experts=2), init_method=_init, bias=False,
                                     skip_bias_add=False, is_expert=True)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(rank))
    out, _ = fc2(x, [2, 4])
    reference = torch.cat([x[:2] @ fc2.weight0.t(), x[2:] @ fc2.weight1.t()])
    parallel_state.destroy_model_parallel()
    return {"out": out.detach(), "reference": reference.detach()}


def test_grouped_experts_without_expert_parallelism_communicate_nothing():
    """The pipeline layout above needs this: with expert TP and EP of 1 the grouped linear keeps its parallel
    mode over the expert TP group of one rank (as megatron-core passes TE); it used to have no group, so its
    collectives spanned the default group (here the data-parallel peer, which summed both ranks' outputs; under
    pipeline parallelism the other stage, which never joined: a hang)."""
    for result in run_distributed(_grouped_without_expert_parallelism, 2):
        assert torch.equal(result["out"], result["reference"])
