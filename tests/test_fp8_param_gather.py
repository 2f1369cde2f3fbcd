"""--fp8-param-gather hooks (megatron.core.fp8_utils on our quantized parameters), checked on real gloo
processes against a single-process quantization of the whole tensor: each rank quantizes only its shard of
the fp32 main parameter, the uint8 codes are all-gathered, and every rank must end with exactly the codes and
scale one quantization of the whole tensor gives."""
import pytest
import torch
import torch.distributed as dist

from mindspeed_te import (
    Linear,
    MXFP8BlockScaling,
    fp8_model_init,
)
from mindspeed_te.megatron.fp8_params import is_float8tensor, modify_underlying_storage, quantize_param_shard
from tests.dist_utils import run_distributed
from tests.recipes import recipes

RECIPES = recipes("tensorwise/e4m3", "tensorwise/hif8", "delayed/hybrid", "blockwise/e4m3")


def _new_main(shape: tuple[int, int]) -> torch.Tensor:
    torch.manual_seed(99)
    return torch.randn(shape) * 0.05


def _sharded_update(rank: int, world_size: int, name: str):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    with fp8_model_init(recipe=recipe):
        layer = Linear(256, 160, bias=False)  # 160 rows: 128x128 tiles cut by the shard boundary
    param = layer.weight
    # Megatron's DDP: the codes move into a flat uint8 buffer.
    buffer = torch.zeros(param.numel(), dtype=torch.uint8)
    view = buffer[:param.numel()].view(param.shape)
    modify_underlying_storage(param, view)
    main = _new_main(tuple(param.shape)).reshape(-1)
    split = param.numel() // world_size  # row 80: the shard boundary cuts a 128x128 tile
    start, end = rank * split, (rank + 1) * split
    quantize_param_shard([param], [main[start:end].clone()], [start], dist.group.WORLD)
    # the parameter all-gather of Megatron's buffer (each rank contributes its shard of the codes)
    mine = param._data.reshape(-1)[start:end].clone()
    dist.all_gather_into_tensor(param._data.reshape(-1), mine)
    return param._data.clone(), param._scale_inv.clone(), param._data.data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("name", list(RECIPES))
def test_shard_quantization_equals_whole_tensor_quantization(name):
    results = run_distributed(_sharded_update, 2, name)
    torch.manual_seed(0)
    with fp8_model_init(recipe=RECIPES[name]):
        reference = Linear(256, 160, bias=False).weight
    reference.quantize_(_new_main(tuple(reference.shape)).to(reference.dtype))
    for data, scale_inv, in_buffer in results:
        assert in_buffer  # the codes live in Megatron's buffer
        assert torch.equal(data, reference._data)
        assert torch.equal(scale_inv, reference._scale_inv)


def test_refuses_weights_with_a_separate_columnwise_copy():
    with fp8_model_init(recipe=MXFP8BlockScaling()):
        param = Linear(64, 64).weight
    assert is_float8tensor(param) and not is_float8tensor(torch.zeros(1))
    with pytest.raises(NotImplementedError, match="--fp8-param-gather"):
        quantize_param_shard([param], [torch.zeros(64 * 64)], [0], None)
