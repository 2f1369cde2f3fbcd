"""Megatron-facing linear classes: same constructor keywords as megatron-core 0.16.1's TE* classes, the
(output, bias) return convention, and FP8 under a Megatron TransformerConfig."""
import ast
import importlib.util
import inspect
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
pytest.importorskip("megatron.core")
# Megatron's TE extension, read as source: 0.12's does not import without TE, and without TE the others define
# their TE* classes on a MagicMock
MCORE_TE_SOURCE = importlib.util.find_spec("megatron.core.extensions.transformer_engine").origin
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mindspeed_te import DelayedScaling, Format, FP8GlobalStateManager, fp8_autocast  # noqa: E402
from mindspeed_te.megatron import (  # noqa: E402
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TEDelayedScaling,
    TEDotProductAttention,
    TEGroupedLinear,
    TELayerNormColumnParallelLinear,
    TELinear,
    TENorm,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)
from mindspeed_te.megatron.common import recipe_from_config  # noqa: E402
from mindspeed_te.modules import LayerNorm, RMSNorm  # noqa: E402
from tests.megatron_compat import config_kwargs  # noqa: E402


def _params(cls):
    sig = inspect.signature(cls.__new__ if "__new__" in vars(cls) else cls.__init__)
    return {n: (p.kind, p.default) for n, p in sig.parameters.items() if n not in ("self", "cls")}


def megatron_init_params(class_name: str) -> dict:
    """Constructor parameters of a class in megatron-core's extensions/transformer_engine.py, read from its
    source: without TransformerEngine installed those classes are built on a MagicMock and have no real
    signature to inspect."""
    tree = ast.parse(open(MCORE_TE_SOURCE).read())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("__init__", "__new__"))
    args = init.args
    result = {}
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        result[arg.arg] = (inspect.Parameter.POSITIONAL_OR_KEYWORD, default)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        result[arg.arg] = (inspect.Parameter.KEYWORD_ONLY, default)
    result.pop("self", None)
    result.pop("cls", None)
    return result


@pytest.mark.parametrize("ours", [TELinear, TEColumnParallelLinear, TERowParallelLinear, TEDelayedScaling,
                                  TENorm, TELayerNormColumnParallelLinear, TEGroupedLinear,
                                  TEColumnParallelGroupedLinear, TERowParallelGroupedLinear, TEDotProductAttention],
                         ids=lambda c: c.__name__)
def test_constructor_accepts_everything_megatron_passes(ours):
    mine, megatron = _params(ours), megatron_init_params(ours.__name__)
    assert megatron, "megatron-core source not parsed"
    for name, (kind, default) in megatron.items():
        assert name in mine, f"{ours.__name__} lacks keyword {name!r}"
        assert mine[name][0] == kind, f"{ours.__name__}.{name}: kind {mine[name][0]} != {kind}"
        has_default = mine[name][1] is not inspect.Parameter.empty
        assert has_default == (default is not None), f"{ours.__name__}.{name}: required-ness differs"
        if isinstance(default, ast.Constant):
            assert mine[name][1] == default.value, f"{ours.__name__}.{name}: default differs"
    for name, (_, default) in mine.items():  # our additions must be optional
        assert name in megatron or default is not inspect.Parameter.empty


def _config(**kw):
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**config_kwargs(**base))


def _init(w):
    torch.nn.init.normal_(w, std=0.02)


def test_return_convention_and_bias_handling():
    cfg = _config()
    layer = TEColumnParallelLinear(64, 128, config=cfg, init_method=_init, gather_output=False, bias=True,
                                   skip_bias_add=True, is_expert=False)
    x = torch.randn(8, 2, 64)
    out, bias = layer(x)
    assert out.shape == (8, 2, 128) and bias is layer.bias
    assert torch.allclose(out, x @ layer.weight.t(), atol=1e-6)
    layer = TERowParallelLinear(64, 32, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
                                skip_bias_add=False, is_expert=False)
    out, bias = layer(x)
    assert bias is None and torch.allclose(out, x @ layer.weight.t() + layer.bias, atol=1e-6)
    assert layer.weight.partition_dim == 1 and layer.weight.allreduce


def test_rejects_unsupported_options_clearly():
    cfg = _config()
    with pytest.raises(ValueError, match="gather_output"):
        TEColumnParallelLinear(64, 64, config=cfg, init_method=_init, gather_output=True, bias=False,
                               skip_bias_add=False, is_expert=False)
    with pytest.raises(ValueError, match="input_is_parallel"):
        TERowParallelLinear(64, 64, config=cfg, init_method=_init, bias=False, input_is_parallel=False,
                            skip_bias_add=False, is_expert=False)
    with pytest.raises(ValueError, match="skip_weight_param_allocation"):
        TELinear(64, 64, parallel_mode="duplicated", config=cfg, init_method=_init, bias=False,
                 skip_bias_add=False, skip_weight_param_allocation=True)


def test_perform_initialization_off_skips_init_and_first_microbatch_flag():
    cfg = _config(perform_initialization=False)
    called = []
    layer = TELinear(64, 64, parallel_mode="duplicated", config=cfg, init_method=lambda w: called.append(1),
                     bias=False, skip_bias_add=False, skip_weight_param_allocation=False)
    assert not called and layer.weight.sequence_parallel is False
    FP8GlobalStateManager.reset()
    with torch.no_grad():
        layer.weight.normal_()
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    with fp8_autocast(fp8_recipe=recipe):
        first, _ = layer(torch.randn(4, 64))
    assert layer.is_first_microbatch is False
    with torch.no_grad():
        layer.weight.mul_(3)  # within the step the weight's FP8 copy is reused (Megatron resets the flag per step)
    with fp8_autocast(fp8_recipe=recipe):
        again, _ = layer(torch.ones(4, 64))
    layer.is_first_microbatch = True
    with fp8_autocast(fp8_recipe=recipe):
        fresh, _ = layer(torch.ones(4, 64))
    assert not torch.allclose(again, fresh)


@pytest.mark.parametrize("fp8, recipe, expected", [
    ("hybrid", "delayed", "DelayedScaling"), ("hif8", "delayed", "DelayedScaling"),
    ("hif8", "tensorwise", "Float8CurrentScaling"), ("e4m3", "blockwise", "Float8BlockScaling"),
    ("hif8", "blockwise", "Float8BlockScaling"), ("e4m3", "mxfp8", "MXFP8BlockScaling"),
])
def test_recipe_from_config(fp8, recipe, expected):
    cfg = _config(fp8=fp8, fp8_recipe=recipe, fp8_margin=1, fp8_amax_history_len=7, fp8_wgrad=False)
    r = recipe_from_config(cfg)
    assert type(r).__name__ == expected and r.fp8_format is Format.from_name(fp8)
    assert not r.fp8_wgrad()
    if recipe == "delayed":
        assert r.margin == 1 and r.amax_history_len == 7 and r.amax_compute_algo == "most_recent"
    if recipe == "blockwise":  # HiF8: the NPU block kernel's amax / target tiles; E4M3: TE's powers of 2
        assert r.fp8_quant_fwd_inp.power_2_scale == r.fp8_quant_bwd_grad.power_2_scale == (fp8 != "hif8")
    d = TEDelayedScaling(cfg, Format.HIF8)
    assert d.amax_history_len == 7 and d.fp8_format is Format.HIF8


def _sharded_worker(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp = parallel_state.get_tensor_model_parallel_group()
    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    cfg = _config()
    col = TEColumnParallelLinear(64, 128, config=cfg, init_method=_init, gather_output=False, bias=True,
                                 skip_bias_add=False, is_expert=False, tp_group=tp)
    row = TERowParallelLinear(128, 64, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
                              skip_bias_add=False, is_expert=False, tp_group=tp)
    out = {}
    for name, layer in (("col", col), ("row", row)):
        sd = layer.sharded_state_dict(prefix=f"{name}.", metadata=meta)
        out[name] = {k: (type(v).__name__, getattr(v, "global_shape", None), getattr(v, "global_offset", None))
                     for k, v in sd.items()}
    parallel_state.destroy_model_parallel()
    return out


def test_sharded_state_dict_layout():
    from tests.dist_utils import run_distributed

    results = run_distributed(_sharded_worker, 2)
    for rank, res in enumerate(results):
        assert res["col"]["col.weight"] == ("ShardedTensor", (128, 64), (64 * rank, 0))
        assert res["col"]["col.bias"] == ("ShardedTensor", (128,), (64 * rank,))
        assert res["row"]["row.weight"] == ("ShardedTensor", (64, 128), (0, 64 * rank))
        assert res["row"]["row.bias"][:2] == ("ShardedTensor", (64,))  # replicated
        assert res["col"]["col._extra_state"][0] == "ShardedObject"


def _replica_worker(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)  # data parallel over `world`
    cfg = _config()
    fc1 = TELayerNormColumnParallelLinear(64, 96, config=cfg, init_method=_init, gather_output=False, bias=True,
                                          skip_bias_add=False, is_expert=False)
    fc2 = TERowParallelLinear(96, 64, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
                              skip_bias_add=False, is_expert=False)
    metadata = {"singleton_local_shards": False}  # what Megatron's MLP passes when saved on its own
    out = {key: value.replica_id for name, layer in (("fc1.", fc1), ("fc2.", fc2))
           for key, value in layer.sharded_state_dict(prefix=name, metadata=metadata).items()}
    out["metadata has dp_cp_group"] = "dp_cp_group" in metadata
    parallel_state.destroy_model_parallel()
    return out


def test_sharded_state_dict_counts_data_parallel_replicas_without_a_dp_group_in_metadata():
    """Megatron's replica_id is (0, TP rank, DP rank): a dp_cp_group missing from `metadata` is Megatron's
    data-parallel group (recorded in `metadata` as Megatron's TE layers do from 0.15 on; before, Megatron keeps the
    metadata in the checkpoint and reads the group itself), not one replica per DP rank."""
    from megatron.core.transformer import utils

    from tests.dist_utils import run_distributed

    for rank, res in enumerate(run_distributed(_replica_worker, 2)):
        assert res.pop("metadata has dp_cp_group") == hasattr(utils, "ensure_metadata_has_dp_cp_group")
        assert set(res) == {f"fc1.{name}" for name in ("layer_norm_weight", "layer_norm_bias", "weight", "bias",
                                                        "_extra_state")} | {"fc2.weight", "fc2.bias",
                                                                            "fc2._extra_state"}
        assert all(replica_id == (0, 0, rank) for replica_id in res.values()), res


def test_te_norm_follows_config():
    norm = TENorm(_config(normalization="RMSNorm", layernorm_zero_centered_gamma=True, sequence_parallel=False),
                  hidden_size=64, eps=1e-6)
    assert isinstance(norm, RMSNorm) and norm.zero_centered_gamma and norm.eps == 1e-6
    assert not norm.weight.any()  # zero-centered: stored gamma starts at 0
    assert isinstance(TENorm(_config(), 64), LayerNorm)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_column_parallel_linear(normalization):
    cfg = _config(normalization=normalization, layernorm_epsilon=1e-6)
    layer = TELayerNormColumnParallelLinear(64, 96, config=cfg, init_method=_init, gather_output=False, bias=True,
                                            skip_bias_add=True, is_expert=False)
    names = [n for n, _ in layer.named_parameters()]
    assert names[:1] == ["layer_norm_weight"] and names[-2:] == ["weight", "bias"]
    x = torch.randn(8, 2, 64)
    out, bias = layer(x)
    norm = (torch.nn.functional.layer_norm(x, (64,), eps=1e-6) if normalization == "LayerNorm"
            else torch.nn.functional.rms_norm(x, (64,), eps=1e-6))
    assert bias is layer.bias and torch.allclose(out, norm @ layer.weight.t(), atol=1e-5)
    with pytest.raises(ValueError, match="is_expert"):
        TELayerNormColumnParallelLinear(64, 96, config=cfg, init_method=_init, gather_output=False, bias=True,
                                        skip_bias_add=True, is_expert=True)


def test_grouped_linear_returns_biases_and_honours_use_gmm_fp8():
    cfg = _config(num_moe_experts=4, moe_ffn_hidden_size=32)
    fc1 = TEColumnParallelGroupedLinear(4, 64, 32, config=cfg, init_method=_init, bias=True, skip_bias_add=True,
                                        is_expert=True)
    x = torch.randn(10, 64)
    out, biases = fc1(x, [1, 2, 3, 4])
    assert out.shape == (10, 32) and len(biases) == 4 and fc1.is_first_microbatch is False
    assert [n for n, _ in fc1.named_parameters()][:2] == ["weight0", "bias0"]
    cfg.use_gmm_fp8 = False
    fc2 = TERowParallelGroupedLinear(4, 32, 64, config=cfg, init_method=_init, bias=False, skip_bias_add=False,
                                     is_expert=True)
    assert not fc2.use_fp8_gemm
    out, bias = fc2(torch.randn(10, 32), [1, 2, 3, 4])
    assert bias is None and out.shape == (10, 64)
    with pytest.raises(ValueError, match="is_expert"):
        TEGroupedLinear(2, 8, 8, parallel_mode=None, config=cfg, init_method=_init, bias=False,
                        skip_bias_add=False, is_expert=False)


def _grouped_sharded_worker(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    cfg = _config(num_moe_experts=4, expert_model_parallel_size=world)
    fc1 = TEColumnParallelGroupedLinear(2, 64, 32, config=cfg, init_method=_init, bias=True, skip_bias_add=False,
                                        is_expert=True)
    sd = fc1.sharded_state_dict(prefix="experts.fc1.", metadata=meta)
    out = {k: (type(v).__name__, getattr(v, "key", None), getattr(v, "global_shape", None),
               getattr(v, "global_offset", None)) for k, v in sd.items()}
    parallel_state.destroy_model_parallel()
    return out


def test_grouped_sharded_state_dict_stacks_experts_across_ep_ranks():
    from tests.dist_utils import run_distributed

    for rank, res in enumerate(run_distributed(_grouped_sharded_worker, 2)):
        for i in range(2):
            kind, key, shape, offset = res[f"experts.fc1.weight{i}"]
            assert (kind, key, shape, offset) == ("ShardedTensor", "experts.fc1.weight", (4, 32, 64),
                                                  (2 * rank + i, 0, 0))
            assert res[f"experts.fc1.bias{i}"][2:] == ((4, 32), (2 * rank + i, 0))
        assert res["experts.fc1._extra_state"][0] == "ShardedObject"


def _init_parity_worker(rank: int, world: int) -> dict:
    """Our TE* linears and Megatron's own ColumnParallelLinear / RowParallelLinear, built with the same
    seed and init_method under the default TP group (no tp_group passed), in both of Megatron's
    initialisation modes."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.registry import PatchRegistry

    device = PatchRegistry()
    register_device_cpu(device)  # Megatron's RNG tracker keeps CUDA generator states
    device.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    try:
        for cpu_init in (False, True):
            cfg = _config(use_cpu_initialization=cpu_init)
            built = {}
            for name, make in (
                ("ours_col", lambda: TEColumnParallelLinear(64, 128, config=cfg, init_method=_init, gather_output=False,
                                                            bias=True, skip_bias_add=False, is_expert=False)),
                ("ours_strided", lambda: TEColumnParallelLinear(64, 128, config=cfg, init_method=_init, stride=2,
                                                                gather_output=False, bias=False, skip_bias_add=False,
                                                                is_expert=False)),
                ("ours_lncol", lambda: TELayerNormColumnParallelLinear(64, 128, config=cfg, init_method=_init,
                                                                       gather_output=False, bias=False,
                                                                       skip_bias_add=False, is_expert=False)),
                ("ours_row", lambda: TERowParallelLinear(128, 64, config=cfg, init_method=_init, bias=True,
                                                         input_is_parallel=True, skip_bias_add=False,
                                                         is_expert=False)),
                ("meg_col", lambda: ColumnParallelLinear(64, 128, config=cfg, init_method=_init, bias=True,
                                                         gather_output=False)),
                ("meg_strided", lambda: ColumnParallelLinear(64, 128, config=cfg, init_method=_init, stride=2,
                                                             bias=False, gather_output=False)),
                ("meg_row", lambda: RowParallelLinear(128, 64, config=cfg, init_method=_init, bias=True,
                                                      input_is_parallel=True, skip_bias_add=False)),
            ):
                torch.manual_seed(99)
                model_parallel_cuda_manual_seed(1234)
                built[name] = make().weight.detach().clone()
            out[cpu_init] = built
    finally:
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_default_tp_group_and_initialisation_match_megatrons_parallel_linears():
    from tests.dist_utils import run_distributed

    results = run_distributed(_init_parity_worker, 2)
    for cpu_init in (False, True):
        ranks = [r[cpu_init] for r in results]
        for w in ranks:
            assert w["ours_col"].shape == (64, 64) and w["ours_row"].shape == (64, 64)  # TP=2 from the default group
            assert torch.equal(w["ours_col"], w["meg_col"])
            assert torch.equal(w["ours_lncol"], w["meg_col"])
            assert torch.equal(w["ours_strided"], w["meg_strided"])
            assert torch.equal(w["ours_row"], w["meg_row"])
        assert not torch.equal(ranks[0]["ours_col"], ranks[1]["ours_col"])  # every rank draws its own shard
    # --use-cpu-initialization splits one master weight: stride 2 interleaves the rank's halves.
    full = torch.cat([r[True]["ours_col"] for r in results])
    strided = torch.cat([r[True]["ours_strided"] for r in results])
    assert torch.equal(strided, torch.cat([full[0:32], full[64:96], full[32:64], full[96:128]]))


def test_megatron_sets_save_original_input_on_our_linears():
    """Megatron calls set_save_original_input on shared experts' and recomputed layers' TE linears (it raises
    unless the module has TE's `save_original_input`); ours take it and still train in FP8."""
    from mindspeed_te import Float8CurrentScaling

    cfg = _config(num_moe_experts=4, moe_ffn_hidden_size=32)
    layer = TEColumnParallelLinear(64, 128, config=cfg, init_method=_init, gather_output=False, bias=True,
                                   skip_bias_add=True, is_expert=False)
    experts = TEColumnParallelGroupedLinear(4, 64, 32, config=cfg, init_method=_init, bias=False,
                                            skip_bias_add=False, is_expert=True)
    try:  # Megatron's own (0.14 on), else the plugin's stand-in that the patches give older releases
        from megatron.core.extensions.transformer_engine import set_save_original_input
    except ImportError:
        from mindspeed_te.megatron import set_save_original_input
    for module in (layer, experts):
        assert module.save_original_input is False
        set_save_original_input(module)
        assert module.save_original_input is True
    x = torch.randn(8, 2, 64, requires_grad=True)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        out, _ = layer(x)
        expert_out, _ = experts(x.reshape(16, 64), [4, 4, 4, 4])
    (out.sum() + expert_out.sum()).backward()
    assert layer.weight.grad is not None and all(w.grad is not None for w in experts.weights)
