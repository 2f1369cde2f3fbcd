"""FP4 in Megatron: --fp4-format e2m1 --fp4-recipe nvfp4|mxfp4 through Megatron's own parse_args, validate_args and
config, `megatron.core.fp4_utils` answering as with TransformerEngine >= 2.7, FP4 weights (--fp4-param-gather),
MoE padding, and the refusals, each naming the flag or field."""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import warnings
from typing import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mindspeed_te import Linear, fp8_model_init
from mindspeed_te.fp4 import unpack_fp4
from mindspeed_te.megatron.fp8_params import modify_underlying_storage, quantize_param_shard
from mindspeed_te.patches.arguments import add_arguments, validate_args, wrap_config_from_args, wrap_parse_args
from mindspeed_te.recipe import MXFP4BlockScaling, NVFP4BlockScaling
from tests.dist_utils import run_distributed
from tests.oracles import e2m1_values, mxfp4_reference, nvfp4_dequantize_reference, nvfp4_reference

pytest.importorskip("megatron.core.fp4_utils")
MEGATRON = os.environ.get("MEGATRON_LM_PATH")
needs_tree = pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")
TINY = ["--transformer-impl", "transformer_engine", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size",
        "1", "--global-batch-size", "1", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


@pytest.fixture
def patched() -> Iterator[None]:
    """The TE patches applied in this process (fp4_utils among them), reverted after the test."""
    warnings.filterwarnings("ignore")
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    try:
        yield
    finally:
        registry.revert()


@pytest.fixture
def megatron_args(monkeypatch, patched):
    """Parse `argv` with Megatron's own parse_args (our hook around it), validate_args and config."""
    monkeypatch.syspath_prepend(MEGATRON)
    from megatron.training import arguments

    def parse(argv: list[str]):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, *argv])
        args = wrap_parse_args(arguments.parse_args)(None, False)
        arguments.validate_args(args, {})
        return args, wrap_config_from_args(arguments.core_transformer_config_from_args)(args)

    return parse


def _active_recipe(context: contextlib.AbstractContextManager):
    from mindspeed_te.state import FP8GlobalStateManager

    with context:
        return FP8GlobalStateManager.get_fp8_recipe() if FP8GlobalStateManager.is_fp8_enabled() else None


@needs_tree
@pytest.mark.parametrize("name,recipe,align", [("nvfp4", NVFP4BlockScaling, 128), ("mxfp4", MXFP4BlockScaling, 32)])
def test_fp4_flags_reach_megatrons_config_and_fp4_utils(megatron_args, name, recipe, align):
    """--fp4-recipe takes our mxfp4 beside Megatron's nvfp4; Megatron's own checks pass (they ask for TE >= 2.7);
    fp4_utils then gives our recipe, an autocast of it on the same state manager, and TE's MoE alignment (128
    rows for NVFP4, TE's get_align_size_for_quantization; one 32-element MX block for MXFP4)."""
    from megatron.core import fp4_utils
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    from megatron.core.utils import is_te_min_version

    args, config = megatron_args(["--fp4-format", "e2m1", "--fp4-recipe", name])
    assert (args.fp4, config.fp4, config.fp4_recipe, config.fp8) == ("e2m1", "e2m1", name, None)
    assert fp4_utils.HAVE_TE and is_te_min_version("2.7.0.dev0")
    assert type(fp4_utils.get_fp4_recipe(config)) is recipe
    assert type(_active_recipe(fp4_utils.get_fp4_context(config, layer_no=0))) is recipe
    assert fp4_utils.get_fp4_align_size(config.fp4_recipe) == align == get_align_size_for_quantization(config)


@needs_tree
def test_first_last_layers_bf16_under_fp4(megatron_args):
    """--first-last-layers-bf16 with 1 layer at the start and 2 at the end of 4: layers 0, 2 and 3 run without
    the FP4 autocast, layer 1 with it."""
    _, config = megatron_args(["--fp4-format", "e2m1", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                               "1", "--num-layers-at-end-in-bf16", "2"])
    from megatron.core import fp4_utils

    quantized = [_active_recipe(fp4_utils.get_fp4_context(config, layer)) is not None for layer in range(4)]
    assert quantized == [False, True, False, False]


@needs_tree
@pytest.mark.parametrize("argv,env,message", [
    (["--fp4-format", "e2m1", "--fp8-format", "e4m3"], {}, "--fp4-format e2m1 and --fp8-format e4m3 cannot"),
    (["--fp4-param-gather"], {}, "--fp4-param-gather needs --fp4-format e2m1"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "custom"], {}, "--fp4-recipe custom is not supported"),
    (["--fp4-format", "e2m1", "--transformer-impl", "local"], {}, "--fp4-format e2m1 needs --transformer-impl"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", "--fp4-param-gather", "--use-distributed-optimizer"], {},
     "--fp4-param-gather with --use-distributed-optimizer needs --fp4-recipe nvfp4 .*got --fp4-recipe mxfp4"),
    (["--fp4-format", "e2m1", "--fp4-param-gather", "--use-distributed-optimizer"],
     {"NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "1"}, "NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1"),
    (["--fp4-format", "e2m1"], {"NVTE_NVFP4_ROW_SCALED_ACTIVATION": "1"}, "NVFP4BlockScaling.row_scaled_activation"),
    (["--fp4-format", "e2m1"], {"NVTE_NVFP4_4OVER6": "weights"}, "NVFP4BlockScaling.nvfp4_4over6"),
    (["--fp4-format", "e2m1"], {"NVTE_BACKWARD_OVERRIDE": "dequantized"}, "NVFP4BlockScaling.backward_override"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", "--hidden-size", "80"], {},
     "blocks of 32, which must divide: --hidden-size = 80"),
    (["--fp4-format", "e2m1", "--seq-length", "24"], {},
     "blocks of 16, which must divide: --seq-length x --micro-batch-size / --context-parallel-size = 24"),
    (["--fp4-format", "e2m1", "--ffn-hidden-size", "200"], {},
     "--ffn-hidden-size / --tensor-model-parallel-size = 200"),
    (["--mxfp4-random-hadamard-transform"], {}, "--mxfp4-random-hadamard-transform: only with --fp4-format e2m1"),
    (["--fp4-format", "e2m1", "--mxfp4-stochastic-rounding"], {},
     "--mxfp4-stochastic-rounding: only with --fp4-recipe mxfp4 .got --fp4-recipe nvfp4.*"
     "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", "--mxfp4-fp8-activations", "--mxfp4-stochastic-rounding"],
     {}, "--mxfp4-stochastic-rounding --mxfp4-fp8-activations: .*stochastic_rounding act on FP4 tensors only"),
])
def test_refused_combinations_name_the_flags(monkeypatch, megatron_args, argv, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        megatron_args(argv)


@needs_tree
@pytest.mark.parametrize("argv,rht,sr,fp8_activations", [
    ([], False, False, False),
    (["--mxfp4-random-hadamard-transform"], True, False, False),
    (["--mxfp4-stochastic-rounding"], False, True, False),
    (["--mxfp4-random-hadamard-transform", "--mxfp4-stochastic-rounding"], True, True, False),
    (["--mxfp4-fp8-activations"], False, False, True),
])
def test_mxfp4_flags_reach_the_recipe_megatron_runs(megatron_args, argv, rht, sr, fp8_activations):
    """Each --mxfp4-* flag lands on the config and turns on its option in the recipe Megatron's FP4 autocast
    runs: the Hadamard transform on the wgrad operands (input and gradient), stochastic rounding on the
    gradient only, MXFP8 inputs and gradients under MXFP4 weights; each quantizer the recipe makes says so."""
    from megatron.core import fp4_utils

    from mindspeed_te.quantizers import MXFP4Quantizer, MXFP8Quantizer
    from mindspeed_te.recipe_state import RecipeState

    _, config = megatron_args(["--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", *argv])
    assert (config.mxfp4_random_hadamard_transform, config.mxfp4_stochastic_rounding,
            config.mxfp4_fp8_activations) == (rht, sr, fp8_activations)
    recipe = _active_recipe(fp4_utils.get_fp4_context(config, layer_no=0))
    assert type(recipe) is MXFP4BlockScaling
    assert (recipe.random_hadamard_transform, recipe.stochastic_rounding, recipe.fp8_activations) == (
        rht, sr, fp8_activations)
    forward = RecipeState.create(recipe, mode="forward", num_quantizers=3).make_quantizers()
    backward = RecipeState.create(recipe, mode="backward", num_quantizers=2).make_quantizers()
    inp, weight, grad = forward[0], forward[1], backward[0]
    assert type(weight) is MXFP4Quantizer and not (weight.with_rht or weight.stochastic_rounding)
    activation = MXFP8Quantizer if fp8_activations else MXFP4Quantizer
    assert type(inp) is activation and type(grad) is activation
    if not fp8_activations:
        assert (inp.with_rht, inp.stochastic_rounding) == (rht, False)
        assert (grad.with_rht, grad.stochastic_rounding) == (rht, sr)


@needs_tree
def test_unknown_fp4_recipe_is_an_argparse_error_listing_ours(megatron_args, capsys):
    with pytest.raises(SystemExit):
        megatron_args(["--fp4-format", "e2m1", "--fp4-recipe", "mxfp6"])
    err = capsys.readouterr().err
    assert "--fp4-recipe: invalid choice: 'mxfp6'" in err and "'mxfp4'" in err and "'nvfp4'" in err


def test_releases_without_fp4_flags_get_none():
    """On megatron-core 0.12 to 0.14 (no --fp4-format), the hook adds no FP4 flag and validation asks for none."""
    parser = add_arguments(argparse.ArgumentParser())
    assert not any(flag.startswith("--fp4") for action in parser._actions for flag in action.option_strings)
    validate_args(parser.parse_args([]))


def test_quant_recipe_override_takes_the_fp4_recipes():
    """Megatron's per-module quant_recipe (fp4_quantization_recipe) gives our FP4 recipes; custom is refused."""
    from mindspeed_te.megatron.te_methods import _override_recipe

    for name, recipe in (("nvfp4", NVFP4BlockScaling), ("mxfp4", MXFP4BlockScaling)):
        override = argparse.Namespace(fp4_quantization_recipe=name, fp8_quantization_recipe=None)
        assert type(_override_recipe(override)) is recipe
    with pytest.raises(ValueError, match="fp4_quantization_recipe 'custom' is not supported"):
        _override_recipe(argparse.Namespace(fp4_quantization_recipe="custom", fp8_quantization_recipe=None))


def _fp4_linear(recipe):
    """A Linear(64 -> 32) built under Megatron's FP4 model-init context (--fp4-param-gather)."""
    from megatron.core import fp4_utils

    config = argparse.Namespace(fp4="e2m1", fp4_param=True, fp4_recipe=recipe, first_last_layers_bf16=False,
                                tp_only_amax_red=False, num_layers=1)
    torch.manual_seed(0)
    with fp4_utils.get_fp4_context(config, is_init=True):
        return Linear(64, 32, bias=False, params_dtype=torch.bfloat16)


def _mxfp4_values(x: np.ndarray) -> torch.Tensor:
    """The OCP MX oracle's MXFP4 values of `x` (rows in blocks of 32)."""
    codes, exps = mxfp4_reference(x)
    scale = np.repeat(np.ldexp(1.0, exps.astype(np.int32) - 127), 32, axis=1)
    return torch.from_numpy((e2m1_values(codes) * scale).astype(np.float32))


def test_fp4_parameters_hold_nvfp4_tiles(patched):
    """--fp4-param-gather with NVFP4: the weight is an FP4 parameter (Megatron's is_nvfp4tensor, and the
    is_float8tensor test the optimizers use for quantized weights), its codes half a byte per element, its values
    TE's 16x16-tile NVFP4 of the initial weight (the oracle's), and an optimizer's copy_ of new fp32 values stores
    their NVFP4 quantization."""
    from megatron.core import fp4_utils, fp8_utils

    weight = _fp4_linear("nvfp4").weight
    assert type(weight).__name__ == "NVFP4Tensor"
    assert fp4_utils.is_nvfp4tensor(weight) and fp8_utils.is_float8tensor(weight)
    # packed two codes per byte; Megatron's buffer sees them one per byte (its all-gather shards by element)
    assert weight._rowwise_data.dtype == torch.uint8 and weight._rowwise_data.numel() == weight.numel() // 2
    assert weight._data.shape == weight.shape and int(weight._data.max()) < 16
    initial = weight.get_high_precision_init_val().float().numpy()
    codes, scales, amax = nvfp4_reference(initial, tile_rows=16)
    assert torch.equal(weight.dequantize(torch.float32), torch.from_numpy(
        nvfp4_dequantize_reference(codes, scales, amax)))
    new = torch.randn(32, 64) * 3
    weight.data.copy_(new)
    codes, scales, amax = nvfp4_reference(new.bfloat16().float().numpy(), tile_rows=16)
    assert torch.equal(weight.dequantize(torch.float32),
                       torch.from_numpy(nvfp4_dequantize_reference(codes, scales, amax)))


def test_fp4_parameters_hold_mxfp4_blocks(patched):
    """--fp4-param-gather with MXFP4: E2M1 codes with one E8M0 scale per 32 elements, as the OCP MX oracle."""
    weight = _fp4_linear("mxfp4").weight
    assert type(weight).__name__ == "MXFP4Tensor"
    initial = weight.get_high_precision_init_val().float().numpy()
    assert torch.equal(weight.dequantize(torch.float32), _mxfp4_values(initial))


def test_fp4_weights_train_a_linear_under_megatrons_fp4_autocast(patched):
    """An FP4 weight in a forward / backward under fp4_utils' autocast: the forward is the GEMM of the stored
    values with the input's FP4 quantization, and the weight gets a gradient of its nominal shape."""
    from megatron.core import fp4_utils

    linear = _fp4_linear("mxfp4")
    config = argparse.Namespace(fp4="e2m1", fp4_recipe="mxfp4", first_last_layers_bf16=False, tp_only_amax_red=False,
                                num_layers=1)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with fp4_utils.get_fp4_context(config):
        out = linear(x)
    out.float().sum().backward()
    expected = _mxfp4_values(x.detach().float().numpy()) @ linear.weight.dequantize(torch.float32).t()
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)
    assert linear.weight.grad is not None and linear.weight.grad.shape == (32, 64)


@pytest.mark.parametrize("recipe,padded", [(NVFP4BlockScaling, [128, 0, 256]), (MXFP4BlockScaling, [32, 0, 160])])
def test_moe_padding_follows_the_fp4_recipe(patched, recipe, padded):
    """Megatron's experts pad each expert's rows with Fp8Padding under the active recipe: to 128 for NVFP4
    (TE's alignment), 32 for MXFP4; Fp8Unpadding takes the rows back exactly."""
    from megatron.core.extensions.transformer_engine import Fp8Padding, Fp8Unpadding

    from mindspeed_te.state import fp8_autocast

    x = torch.randn(135, 8)
    with fp8_autocast(enabled=True, fp8_recipe=recipe()):
        out, splits = Fp8Padding(3)(x, [5, 0, 130])
        back = Fp8Unpadding(3)(out, [5, 0, 130])
    assert splits == padded and out.shape[0] == sum(padded)
    assert torch.equal(out[:5], x[:5]) and torch.equal(out[128 if padded[0] == 128 else 32:][:130], x[5:])
    assert torch.equal(back, x)


def _nvfp4_weight() -> torch.Tensor:
    torch.manual_seed(0)
    with fp8_model_init(recipe=NVFP4BlockScaling()):
        return Linear(256, 176, bias=False, params_dtype=torch.bfloat16).weight


def _new_main(shape) -> torch.Tensor:
    torch.manual_seed(99)
    return torch.randn(shape) * 0.05


def _forms(param) -> list[torch.Tensor]:
    storage = param._storage
    return [storage.rowwise_data, storage.rowwise_scale_inv.view(torch.uint8), storage.columnwise_data,
            storage.columnwise_scale_inv.view(torch.uint8), storage.amax_rowwise, storage.amax_columnwise]


def _sharded_nvfp4_update(rank: int, world_size: int, packed: bool) -> tuple[list[torch.Tensor], bool]:
    """Megatron's distributed optimizer on an FP4 weight over 2 gloo ranks: codes moved into a flat uint8 buffer
    (megatron-core 0.16: one per byte through `_data`; 0.17 on: packed through `_rowwise_data`, as its
    modify_nvfp4_rowwise_storage does), each rank quantizes its shard of the new fp32 main parameter (the boundary
    cuts a row of 16x16 tiles), then the buffer's all-gather."""
    param = _nvfp4_weight()
    per_element = 2 if packed else 1
    buffer = torch.zeros(param.numel() // per_element + 64, dtype=torch.uint8)
    if packed:
        view = buffer[64:].view(param._rowwise_data.shape)
        view.copy_(param._rowwise_data)
        param._rowwise_data = view
    else:
        modify_underlying_storage(param, buffer[64:].view(param.shape))
    main = _new_main(tuple(param.shape)).reshape(-1)
    split = param.numel() // 2  # row 88: inside the sixth row of 16x16 tiles
    start, end = rank * split, (rank + 1) * split
    quantize_param_shard([param], [main[start:end].clone()], [start], dist.group.WORLD)
    gathered = buffer[64:]
    dist.all_gather_into_tensor(gathered, gathered[start // per_element:end // per_element].clone())
    held = param._rowwise_data if packed else param._data
    return [t.clone() for t in _forms(param)], held.data_ptr() == buffer[64:].data_ptr()


@pytest.mark.parametrize("packed", [False, True], ids=["one-code-per-byte", "packed"])
def test_distributed_optimizer_shards_make_the_whole_tensors_nvfp4(packed):
    """--fp4-param-gather with --use-distributed-optimizer: after the shard casts and the all-gather, every rank
    holds exactly the packed rowwise and columnwise forms, scales and amax of one NVFP4 quantization of the whole
    new weight, whose values are the oracle's; the codes live in Megatron's buffer (one per byte up to
    megatron-core 0.16, packed from 0.17)."""
    reference = _nvfp4_weight()
    new = _new_main(tuple(reference.shape)).to(reference.dtype)
    reference.quantize_(new)
    codes, scales, amax = nvfp4_reference(new.float().numpy(), tile_rows=16)
    assert torch.equal(reference.dequantize(torch.float32),
                       torch.from_numpy(nvfp4_dequantize_reference(codes, scales, amax)))
    for forms, in_buffer in run_distributed(functools.partial(_sharded_nvfp4_update, packed=packed), 2):
        assert in_buffer
        for got, want in zip(forms, _forms(reference)):
            assert torch.equal(got, want)


def test_a_shard_inside_a_byte_writes_only_its_nibbles():
    """A shard of a packed FP4 weight that starts and ends at odd elements: its codes are those of one cast of the
    whole tensor, every other element's code (both neighbours in the shared bytes) is left as it was."""
    param = _nvfp4_weight()
    view = torch.zeros(param.numel() // 2, dtype=torch.uint8).view(param._rowwise_data.shape)
    view.copy_(param._rowwise_data)
    param._rowwise_data = view
    before = unpack_fp4(view).reshape(-1).clone()
    start, end = 16 * 256 + 3, 40 * 256 + 7  # odd: the first and last bytes hold a neighbour's code too
    main = torch.zeros(param.numel())  # one rank: the other shards count as zeros for the amaxes
    main[start:end] = _new_main(tuple(param.shape)).reshape(-1)[start:end]
    quantize_param_shard([param], [main[start:end].clone()], [start], None)
    whole = _nvfp4_weight()
    whole.quantize_(main.view(param.shape).to(param.dtype))
    after = unpack_fp4(param._rowwise_data).reshape(-1)
    assert torch.equal(after[start:end], unpack_fp4(whole._rowwise_data).reshape(-1)[start:end])
    assert torch.equal(after[:start], before[:start]) and torch.equal(after[end:], before[end:])


def test_mxfp4_weights_are_refused_by_the_distributed_optimizer():
    """MXFP4 weights keep a columnwise copy of their own 32-element blocks: not rebuilt from gathered codes."""
    torch.manual_seed(0)
    with fp8_model_init(recipe=MXFP4BlockScaling()):
        param = Linear(64, 64, bias=False).weight
    with pytest.raises(NotImplementedError, match="only NVFP4 with 16x16 weight tiles"):
        modify_underlying_storage(param, torch.zeros(param.shape, dtype=torch.uint8))
