"""The FP8 hot path never synchronizes the host with the device: no .item(), .tolist(), bool(tensor) or
device-to-host copies in forward, backward or the scale update."""
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.diagnostics import HostSyncCounter, HostSyncError
from mindspeed_te.modules import Linear


def test_counter_sees_syncs():
    t = torch.ones(3)
    with HostSyncCounter() as counter:
        t.sum().item()
        bool(t.any())
        t.tolist()
    assert counter.counts == {"item": 1, "bool": 1, "tolist": 1}


@pytest.mark.parametrize("recipe", [
    DelayedScaling(fp8_format=Format.HIF8), DelayedScaling(fp8_format=Format.HYBRID),
    Float8CurrentScaling(fp8_format=Format.HIF8), Float8BlockScaling(), MXFP8BlockScaling(),
], ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
def test_linear_step_has_no_host_sync(recipe):
    # The per-step NaN/Inf check is on: it copies the flags to the host without waiting (read below).
    layer = Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):  # the second step runs with scales produced by the first update
        with HostSyncCounter() as counter:
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.sum().backward()
        assert counter.total == 0, dict(counter.counts)


def test_the_trap_raises_where_the_host_would_wait():
    t = torch.ones(3, requires_grad=True)
    with pytest.raises(HostSyncError, match="item"), HostSyncCounter(trap=True):
        t.sum().item()
    # inside a backward too, where torch function modes do not reach
    y = (t * 2).sum()
    y.register_hook(lambda g: g * g.item())
    with pytest.raises(HostSyncError, match="item"), HostSyncCounter(trap=True):
        y.backward()


def test_nonfinite_check_makes_no_host_read_inside_a_step():
    """The check at each step's end copies the flags to the host without waiting; the step boundary reads
    them, one host read per check."""
    layers = [Linear(64, 64, name=f"fc{i}") for i in range(3)]
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):
        with HostSyncCounter(trap=True):
            with fp8_autocast(fp8_recipe=DelayedScaling()):
                y = layers[2](layers[1](layers[0](x)))
            y.sum().backward()
    with HostSyncCounter() as counter:
        assert FP8GlobalStateManager.harvest_nonfinite() == []
    assert dict(counter.counts) == {"tolist": 2}


def _gpt_step_with_a_fault(rank: int, world_size: int, fp8: str, recipe: str) -> dict:
    """Two training steps of a megatron-core GPTModel (Megatron's TE layer spec, patched) through Megatron's own
    schedule, 2 micro-batches each (gradient accumulation), the plugin's non-finite check on. The second step runs
    in a host-sync trap: any .item(), .tolist(), bool(t), .cpu() or blocking device-to-host copy in the forward
    or backward of a micro-batch raises. A NaN is put into the input of decoder.layers.1.mlp.linear_fc2 in its
    second micro-batch. Returns what was reported inside the step and at its boundary."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|full scope is deprecated).*")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry
    from mindspeed_te.patches.training import name_fp8_modules
    from tests.megatron_compat import config_kwargs

    registry = PatchRegistry()
    register_megatron_te(registry)
    register_device_cpu(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    config = TransformerConfig(**config_kwargs(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        fp8=fp8, fp8_recipe=recipe))
    model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=128, max_sequence_length=32)
    name_fp8_modules([model])  # as the train_step patch does: warnings name the layer by its path
    target = "decoder.layers.1.mlp.linear_fc2"
    fault = {"micro_batch": None, "seen": 0}

    def poison(module: torch.nn.Module, args: tuple) -> tuple:
        fault["seen"] += 1
        if fault["seen"] != fault["micro_batch"]:
            return args
        x = args[0].clone()
        x.view(-1)[7] = float("nan")
        return (x, *args[1:])

    model.get_submodule(target).register_forward_pre_hook(poison)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(4)]
    positions = torch.arange(32).expand(2, -1)
    mask = torch.ones(2, 1, 32, 32, dtype=torch.bool).tril().logical_not()

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        return model(tokens, positions, mask, labels=tokens), lambda out: (out.float().mean(), {})

    def step(batch_pair: list) -> list:
        model.zero_grad()
        return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batch_pair),
                                           model=[model], num_microbatches=2, seq_length=32, micro_batch_size=2,
                                           forward_only=False)

    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(batches[:2])  # a clean step, outside the trap
        result["clean"] = FP8GlobalStateManager.harvest_nonfinite()
        fault["seen"], fault["micro_batch"] = 0, 2
        try:
            with HostSyncCounter(trap=True) as trap:
                step(batches[2:])
        except HostSyncError as error:  # a test failure with the traceback's message, not a pickling error
            result["sync"] = repr(error)
        result["counted"] = dict(trap.counts)
        result["pending"] = len(FP8GlobalStateManager.quantization_state.nonfinite_reports)
        result["warned_in_step"] = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
        result["boundary"] = FP8GlobalStateManager.harvest_nonfinite()  # what train_step's patch calls
        result["warnings"] = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
    result["poisoned"] = fault["seen"]
    parallel_state.destroy_model_parallel()
    registry.revert()
    return result


@pytest.mark.parametrize("fp8,recipe", [("hif8", "delayed"), ("e4m3", "tensorwise")])
def test_megatron_gpt_step_reads_nothing_on_the_host_and_reports_at_its_boundary(fp8, recipe):
    """Issue 30: with the non-finite check on, no host read in the forward or backward of any micro-batch of a
    Megatron GPT step (delayed scaling: one region per micro-batch; tensorwise: one per layer), and a NaN in one
    layer's input in micro-batch 2 is still reported, naming that layer, at the step boundary."""
    pytest.importorskip("megatron.core")
    from tests.dist_utils import run_distributed

    result = run_distributed(_gpt_step_with_a_fault, 1, fp8, recipe)[0]
    assert "sync" not in result, result["sync"]
    assert result["counted"] == {}
    assert result["clean"] == [] and result["poisoned"] == 2
    assert result["pending"] == 2  # one check per micro-batch, both still on their way
    assert result["warned_in_step"] == []
    found = result["boundary"]
    # the one input that held NaN is named (the loss, and so every gradient, is NaN too)
    assert [name for name in found if name.endswith(" input")] == ["decoder.layers.1.mlp.linear_fc2 input"], found
    assert len(result["warnings"]) == 1 and "decoder.layers.1.mlp.linear_fc2 input" in result["warnings"][0]
