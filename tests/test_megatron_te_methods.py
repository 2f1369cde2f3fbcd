"""The TE* methods megatron-core 0.16.1 calls besides forward, checked against its documented behaviour:
backward_dw (delayed wgrad for the 1F1B overlap), finish_init (per-module quant_recipe override) with
will_execute_quantized, TEGroupedLinear's per-expert _extra_state in sharded checkpoints, and a GPTModel
built from Megatron's TE spec under fp8_model_init."""
from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
pytest.importorskip("megatron.core")
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mindspeed_te import (  # noqa: E402
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    GroupedLinear,
    Linear,
    QuantizedTensor,
    fp8_autocast,
    fp8_model_init,
)
from mindspeed_te.megatron import (  # noqa: E402
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)
from mindspeed_te.modules import LayerNormMLP  # noqa: E402
from mindspeed_te.patches.registry import has_module  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.megatron_compat import te_extension_has  # noqa: E402
from tests.test_megatron_linear import _config, _init  # noqa: E402

# Megatron's per-module quantization override for TE modules (quant_recipe entries of type TEQuantizationParams,
# handed over by finish_init): megatron-core 0.16 on (0.13 to 0.15 have quant_recipe for NVIDIA Kitchen only)
QUANT_CONFIG = "megatron.core.quantization.quant_config"
TE_QUANT_PARAMS = has_module(QUANT_CONFIG) and te_extension_has("TEQuantizationParams")
needs_quant_config = pytest.mark.skipif(not TE_QUANT_PARAMS, reason="this megatron-core has no TE quantization "
                                        "params for quant_recipe (0.16 on)")


def _te_linears(config):
    return {
        "column": TEColumnParallelLinear(64, 96, config=config, init_method=_init, gather_output=False, bias=True,
                                         skip_bias_add=False, is_expert=False),
        "row": TERowParallelLinear(96, 64, config=config, init_method=_init, bias=True, input_is_parallel=True,
                                   skip_bias_add=True, is_expert=False),
        "layernorm_column": TELayerNormColumnParallelLinear(64, 96, config=config, init_method=_init,
                                                            gather_output=False, bias=False, skip_bias_add=False,
                                                            is_expert=False),
    }


RECIPES = {"high precision": None, "tensorwise/e4m3": lambda: Float8CurrentScaling(fp8_format=Format.E4M3),
           "delayed/hybrid": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=2)}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_backward_dw_runs_the_skipped_wgrad_with_identical_results(recipe, fused):
    """With config.delay_wgrad_compute the backward computes input gradients only; backward_dw() then runs
    each weight-gradient GEMM on the saved operands: the weight gradients equal the undelayed run's bit for
    bit (also accumulated into main_grad with gradient-accumulation fusion). Megatron's DDP hooks, registered
    through register_wgrad_accumulation_and_reduce_hooks, run in backward_dw."""
    make = RECIPES[recipe]
    runs = {}
    for delay in (False, True):
        torch.manual_seed(0)
        config = _config(gradient_accumulation_fusion=fused)
        config.delay_wgrad_compute = delay  # (TransformerConfig asks for the MoE overlap flag alongside it)
        layers = _te_linears(config)
        hooked = []
        for name, layer in layers.items():
            for p in layer.parameters():
                p.main_grad = torch.zeros(p.shape)
            layer.register_wgrad_accumulation_and_reduce_hooks(lambda name=name, hooked=hooked: hooked.append(name))
        x = torch.randn(8, 2, 64, requires_grad=True)
        for microbatch in range(2):  # two micro-batches: gradients accumulate across them
            with fp8_autocast(enabled=make is not None, fp8_recipe=make() if make else None):
                h, _ = layers["column"](x)
                y, bias = layers["row"](h)
                z, _ = layers["layernorm_column"](y + bias)
            z.square().sum().backward()
            if delay:
                weights = [layer.weight for layer in layers.values()]
                if microbatch == 0:
                    assert all(w.grad is None for w in weights)
                    if fused:
                        assert all(not w.main_grad.any() for w in weights)
                assert x.grad is not None  # the input gradient did not wait
                for layer in layers.values():
                    layer.backward_dw()
        runs[delay] = {f"{n}.{pn}": (p.main_grad if fused and pn == "weight" else p.grad).clone()
                       for n, layer in layers.items() for pn, p in layer.named_parameters()}
        runs[delay]["x"] = x.grad
        if delay:
            assert hooked == ["column", "row", "layernorm_column"] * 2
            assert all(layer.weight.skip_backward_post_hook for layer in layers.values())
    assert runs[True].keys() == runs[False].keys()
    for key, value in runs[False].items():
        assert torch.equal(runs[True][key], value), key


def test_backward_dw_is_a_no_op_unless_megatron_asks_for_delayed_wgrad():
    config = _config()
    layer = _te_linears(config)["column"]
    x = torch.randn(4, 64)
    layer(x)[0].sum().backward()
    grad = layer.weight.grad.clone()
    layer.backward_dw()  # delay_wgrad_compute off: nothing queued, nothing done
    assert torch.equal(layer.weight.grad, grad) and not layer.need_backward_dw()
    module = Linear(64, 32, delay_wgrad_compute=True)
    with pytest.raises(RuntimeError, match="no delayed weight gradient"):
        module.backward_dw()


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_backward_dw_gives_identical_expert_gradients(fp8):
    grads = {}
    for delay in (False, True):
        torch.manual_seed(1)
        config = _config(num_moe_experts=4)
        config.delay_wgrad_compute = delay
        fc1 = TEColumnParallelGroupedLinear(4, 64, 32, config=config, init_method=_init, bias=True,
                                            skip_bias_add=False, is_expert=True)
        x = torch.randn(10, 64)
        with fp8_autocast(enabled=fp8, fp8_recipe=Float8CurrentScaling(fp8_format=Format.E4M3)):
            out, _ = fc1(x, [3, 0, 4, 3])
        out.square().sum().backward()
        if delay:
            assert all(w.grad is None for w in fc1.weights)
            fc1.backward_dw()
        grads[delay] = {n: p.grad for n, p in fc1.named_parameters()}
    for name, grad in grads[False].items():
        assert torch.equal(grads[True][name], grad), name
    assert not grads[True]["weight1"].any()  # the expert without rows gets an explicit zero, as without delay


def _quant_config(training_recipe: dict, evaluation_recipe: dict | None = None):
    from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig

    config = {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": training_recipe}
    if evaluation_recipe is not None:
        config["evaluation_recipe"] = evaluation_recipe
    context = MatchContext(module_path="decoder.layers.0.mlp.linear_fc1", layer_number=0)
    return QuantizationConfig(config, context, "override")


@pytest.mark.skipif(TE_QUANT_PARAMS, reason="this megatron-core has TE quantization params")
def test_finish_init_override_is_refused_where_megatron_has_no_te_quantization_params():
    """0.13 to 0.15 call finish_init with Kitchen-only quant_recipe entries: None is no override, anything else a
    clear error instead of an ImportError."""
    layer = _te_linears(_config())["column"]
    layer.finish_init(None)
    assert layer.te_quant_params is None
    with pytest.raises(ValueError, match="per-module quantization of TE modules needs megatron-core 0.16"):
        layer.finish_init(object())


@needs_quant_config
def test_finish_init_override_forces_high_precision_inside_fp8_regions():
    """A training_recipe without an FP8 recipe (Megatron: "force BF16 for this layer") keeps the module in high
    precision inside an FP8 region; will_execute_quantized says so; finish_init(None) removes the override."""
    torch.manual_seed(2)
    layer = _te_linears(_config())["column"]
    x = torch.randn(16, 64)
    high = layer(x)[0].detach()
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    with fp8_autocast(fp8_recipe=recipe):
        quantized = layer(x)[0].detach()
    assert not torch.equal(quantized, high)
    layer.finish_init(_quant_config({}))
    assert layer.te_quant_params is not None
    assert layer.will_execute_quantized(True) is False and layer.will_execute_quantized(False) is False
    with fp8_autocast(fp8_recipe=recipe):
        assert torch.equal(layer(x)[0].detach(), high)
        assert FP8GlobalStateManager.is_fp8_enabled()  # the region itself is untouched for other modules
    layer.finish_init(None)
    assert layer.te_quant_params is None and layer.will_execute_quantized(True) is True
    with fp8_autocast(fp8_recipe=recipe):
        assert torch.equal(layer(x)[0].detach(), quantized)


@needs_quant_config
def test_finish_init_override_quantizes_outside_regions_and_in_evaluation():
    """override_nonquantized_autocast with a tensorwise recipe turns FP8 on for this module alone; a separate
    evaluation_recipe applies when the module is not training."""
    torch.manual_seed(3)
    layer = _te_linears(_config())["column"]
    x = torch.randn(16, 64)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling(fp8_format=Format.HYBRID)):
        expected = layer(x)[0].detach()
    high = layer(x)[0].detach()
    layer.finish_init(_quant_config(
        {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid", "override_nonquantized_autocast": True},
        evaluation_recipe={"override_quantized_autocast": False}))
    assert layer.will_execute_quantized(False) is True
    assert torch.equal(layer(x)[0].detach(), expected)
    assert not FP8GlobalStateManager.is_fp8_enabled()
    layer.eval()  # the evaluation recipe: keep whatever the context says
    assert layer.will_execute_quantized(False) is False and torch.equal(layer(x)[0].detach(), high)
    with pytest.raises(ValueError, match="Delayed scaling"):  # Megatron's own parser refuses it
        layer.finish_init(_quant_config({"fp8_quantization_recipe": "delayed"}))


def test_will_execute_quantized_on_the_generic_modules():
    """Megatron's FP8 inference padding asks modules whether they will run quantized in the current
    context: TE's modules follow the context; grouped GEMMs kept in high precision (--no-use-gmm-fp8) never do."""
    for module in (Linear(32, 32), LayerNormMLP(32, 64), GroupedLinear(2, 32, 32)):
        assert module.will_execute_quantized(True) is True and module.will_execute_quantized(False) is False
    high = GroupedLinear(2, 32, 32, use_fp8_gemm=False)
    assert high.will_execute_quantized(True) is False
    config = _config(num_moe_experts=2)
    config.use_gmm_fp8 = False
    fc2 = TERowParallelGroupedLinear(2, 32, 64, config=config, init_method=_init, bias=False, skip_bias_add=False,
                                     is_expert=True)
    assert fc2.will_execute_quantized(True) is False


def _grouped_with_state(num_gemms: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    fc1 = TEColumnParallelGroupedLinear(num_gemms, 64, 32, config=_config(num_moe_experts=num_gemms), init_method=_init,
                                        bias=True, skip_bias_add=False, is_expert=True)
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=3)
    for step in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            out, _ = fc1(torch.randn(12, 64) * (step + 1), [4, 2, 0, 6] if num_gemms == 4 else [5, 7])
        out.sum().backward()
    return fc1


def test_split_and_merge_extra_state_per_expert():
    """_split_extra_state gives expert i its own quantizers (forward slots i, n+i, 2n+i, backward i, n+i: TE's
    grouped layout) as a one-GEMM module keeps them; loading `_extra_state`, `_extra_state1`, ... (a
    dist-checkpoint's per-expert entries) merges them back into the module's amax histories and scales
    exactly."""
    source = _grouped_with_state()
    fwd, bwd = source.fp8_states
    pieces = source._split_extra_state(source.state_dict()["_extra_state"])
    assert len(pieces) == 4
    for i, piece in enumerate(pieces):
        meta = source._decode_extra_state(piece)
        assert torch.equal(meta["fwd_amax_history"], fwd.amax_history[:, [i, 4 + i, 8 + i]])
        assert torch.equal(meta["bwd_scale"], bwd.scale[[i, 4 + i]])
    assert source._decode_extra_state(torch.empty(0, dtype=torch.uint8)) is None
    state = {k: v for k, v in source.state_dict().items() if k != "_extra_state"}
    state.update({"_extra_state" if i == 0 else f"_extra_state{i}": p for i, p in enumerate(pieces)})
    target = _grouped_with_state(seed=9)
    target.load_state_dict(state)  # strict: the per-expert keys are consumed
    for ours, theirs in zip(target.fp8_states, source.fp8_states):
        assert torch.equal(ours.amax_history, theirs.amax_history) and torch.equal(ours.scale, theirs.scale)
    fresh = TEColumnParallelGroupedLinear(4, 64, 32, config=_config(num_moe_experts=4), init_method=_init, bias=True,
                                          skip_bias_add=False, is_expert=True)
    unused = fresh.state_dict()["_extra_state"]  # saved before any FP8 step: every expert gets it as it is
    assert [piece is unused for piece in fresh._split_extra_state(unused)] == [True] * 4


def _sharded_worker(rank: int, world: int, singleton: bool) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
            "singleton_local_shards": singleton}
    fc1 = _grouped_with_state(num_gemms=2)
    sd = fc1.sharded_state_dict(prefix="experts.fc1.", metadata=meta)
    out = {k: (type(v).__name__, v.key, getattr(v, "global_shape", None), getattr(v, "global_offset", None),
               v.replica_id) for k, v in sd.items()}
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("singleton", [False, True], ids=["stacked", "singleton_local_shards"])
def test_sharded_state_dict_has_one_extra_state_per_expert(singleton):
    """EP=2, two local experts per rank. Megatron's layout: `_extra_state` (expert 0) and `_extra_state1`
    (expert 1), each a ShardedObject at the expert's global index; with singleton_local_shards each expert's
    entries are keyed by its global index instead and carry no expert axis."""
    for rank, res in enumerate(run_distributed(_sharded_worker, 2, singleton)):
        assert set(res) == {"experts.fc1.weight0", "experts.fc1.weight1", "experts.fc1.bias0", "experts.fc1.bias1",
                            "experts.fc1._extra_state", "experts.fc1._extra_state1"}
        for i, extra in enumerate(("experts.fc1._extra_state", "experts.fc1._extra_state1")):
            expert = 2 * rank + i
            kind, key, shape, offset, replica = res[extra]
            weight = res[f"experts.fc1.weight{i}"]
            assert kind == "ShardedObject" and replica == (0, 0, 0)
            if singleton:
                assert key == f"{expert}.experts.fc1._extra_state" and shape == (1,) and offset == (0,)
                assert weight[1] == f"{expert}.experts.fc1.weight" and weight[2] == (32, 64)
            else:
                assert key == "experts.fc1._extra_state" and shape == (4,) and offset == (expert,)
                assert weight[1] == "experts.fc1.weight" and weight[2:4] == ((4, 32, 64), (expert, 0, 0))


def _gpt_under_fp8_model_init(rank: int, world: int, recipe_name: str) -> dict:
    """A GPTModel from Megatron's TE layer spec (patched to our TE* classes), built under fp8_model_init, with
    a quant_recipe override on the FC2 layers; three SGD steps inside the FP8 region."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(1, 1)
    recipe = {"tensorwise": Float8CurrentScaling(fp8_format=Format.E4M3),
              "delayed": DelayedScaling(fp8_format=Format.HIF8, amax_history_len=2)}[recipe_name]
    override = {}
    if TE_QUANT_PARAMS:  # FC2 in high precision through Megatron's quant_recipe, where it has one
        from megatron.core.quantization.quant_config import GlobMatcher, RecipeConfig

        override["quant_recipe"] = RecipeConfig([GlobMatcher("*linear_fc2", "bf16")],
                                                {"bf16": {"transformer_engine_config_type": "TEQuantizationParams",
                                                          "training_recipe": {}}})
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                               masked_softmax_fusion=False, bias_activation_fusion=False, hidden_dropout=0.0,
                               attention_dropout=0.0, **override)
    torch.manual_seed(0)
    with fp8_model_init(recipe=recipe):
        model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=128, max_sequence_length=32)
    te_modules = {name: m for name, m in model.named_modules() if hasattr(m, "finish_init")}
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(2, -1)
    mask = torch.ones(2, 1, 32, 32, dtype=torch.bool).tril().logical_not()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with fp8_autocast(fp8_recipe=recipe):
            loss = model(tokens, positions, mask, labels=tokens).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = {
        "quantized": {name: type(m.weight).__name__ for name, m in te_modules.items()},
        "data_bytes": {name: m.weight._data.element_size() for name, m in te_modules.items()
                       if isinstance(m.weight, QuantizedTensor)},
        "overridden": sorted(name for name, m in te_modules.items() if m.te_quant_params is not None),
        "losses": losses,
    }
    parallel_state.destroy_model_parallel()
    registry.revert()
    return result


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_megatron_gpt_built_under_fp8_model_init_holds_quantized_weights_and_trains(recipe):
    """Every TE* linear Megatron's spec builds inside fp8_model_init holds its weight as a QuantizedTensor
    with 1-byte codes; GPTModel's finish_init hands each module its quant_recipe entry (the FC2 layers
    here); SGD on the FP8 weights lowers the loss."""
    result = run_distributed(_gpt_under_fp8_model_init, 1, recipe)[0]
    names = result["quantized"]
    assert len(names) == 8 and any(n.endswith("linear_qkv") for n in names)  # qkv, proj, fc1, fc2 of 2 layers
    assert set(names.values()) == {"Float8Tensor"}
    assert set(result["data_bytes"].values()) == {1}
    overridden = [n for n in names if n.endswith("linear_fc2")] if TE_QUANT_PARAMS else []
    assert result["overridden"] == sorted(overridden)
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0], losses
