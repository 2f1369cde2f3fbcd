"""The Megatron TE patches against the real megatron-core: specs, importers, fp8 context, a GPT model."""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import warnings
from contextlib import nullcontext

import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
pytest.importorskip("megatron.core")

from mindspeed_te import FP8GlobalStateManager  # noqa: E402
from mindspeed_te.patches.device_cpu import register_device_cpu  # noqa: E402
from mindspeed_te.patches.megatron_te import EXTENSION, IMPORTERS, TE_CLASSES, register_megatron_te  # noqa: E402
from mindspeed_te.patches.registry import PatchRegistry, has_module  # noqa: E402
from mindspeed_te.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.megatron_compat import config_kwargs, has_config_field  # noqa: E402


@pytest.fixture
def patched():
    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    yield registry
    registry.revert()


def _te_names_imported(module_name: str) -> set[str]:
    """Names `module_name` imports from Megatron's TE extension, read from its source."""
    module = importlib.import_module(module_name)
    with open(module.__file__) as source:  # (inspect.getsource trips over bert_layer_specs' attributes)
        tree = ast.parse(source.read())
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module == EXTENSION for alias in node.names}


def test_every_te_name_on_the_gpt_path_is_ours(patched):
    modules = [*IMPORTERS, EXTENSION + "_spec_provider", "megatron.core.transformer.moe.shared_experts",
               "megatron.core.transformer.attention"]
    for module_name in filter(has_module, modules):
        module = importlib.import_module(module_name)
        for name in _te_names_imported(module_name) & set(TE_CLASSES):
            bound = getattr(module, name, None)
            # a module whose TE import block failed early may never look the name up; if bound, it is ours
            if module_name in IMPORTERS and name in IMPORTERS[module_name][0]:
                assert bound is TE_CLASSES[name], f"{module_name}.{name}"
            elif bound is not None:
                assert bound is TE_CLASSES[name], f"{module_name}.{name} is {bound!r}"


def _submodules(spec):
    """A spec's submodules: a ModuleSpec's, or those bound into a functools.partial (megatron-core 0.17 on)."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def test_gpt_layer_specs_use_our_modules(patched):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from mindspeed_te import megatron as ours

    spec = get_gpt_layer_with_transformer_engine_spec()
    attention, mlp = _submodules(spec.submodules.self_attention), _submodules(spec.submodules.mlp)
    assert attention.linear_qkv is ours.TELayerNormColumnParallelLinear
    assert attention.core_attention is ours.TEDotProductAttention
    assert attention.linear_proj is ours.TERowParallelLinear
    assert (mlp.linear_fc1, mlp.linear_fc2) == (ours.TELayerNormColumnParallelLinear, ours.TERowParallelLinear)

    moe = _submodules(get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True).submodules.mlp)
    experts = _submodules(moe.experts)
    assert (experts.linear_fc1, experts.linear_fc2) == (ours.TEColumnParallelGroupedLinear,
                                                        ours.TERowParallelGroupedLinear)
    shared = _submodules(moe.shared_experts)
    assert (shared.linear_fc1, shared.linear_fc2) == (ours.TEColumnParallelLinear, ours.TERowParallelLinear)


def _module(spec):
    """The class a spec builds: a ModuleSpec's module, or the class whose builder a functools.partial binds
    (0.19 on: `MLP.as_mlp_submodule`)."""
    return getattr(spec.func, "__self__", spec.func) if isinstance(spec, functools.partial) else spec.module


def _build(spec, config):
    """A module from a spec as Megatron builds it: build_module, or the bound builder called with what a
    TransformerLayer passes it (0.19 on)."""
    from megatron.core.transformer.spec_utils import build_module

    if isinstance(spec, functools.partial):
        from megatron.core.process_groups_config import ProcessGroupCollection

        return spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False)
    return build_module(spec, config=config)


def _fused_and_plain_mlp(rank: int, world_size: int) -> dict:
    """TEFusedMLP and Megatron's MLP built from the TE spec with the same parameters, on one gloo rank."""
    warnings.filterwarnings("ignore")
    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import build_module

    from mindspeed_te import megatron as ours

    parallel_state.initialize_model_parallel(1, 1)
    fused_spec = get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=True).submodules.mlp
    plain_spec = get_gpt_layer_with_transformer_engine_spec().submodules.mlp
    config = _config()
    torch.manual_seed(0)
    fused, plain = _build(fused_spec, config), _build(plain_spec, config)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(8, 2, 64, requires_grad=True)
    outputs = {}
    for name, mlp in (("fused", fused), ("plain", plain)):
        y, _ = mlp(x)
        outputs[name] = (y.detach(), torch.autograd.grad(y.square().sum(), x)[0])
    try:
        build_module(ours.TEFusedMLP, config=config, submodules=MLPSubmodules(
            linear_fc1=ours.TEColumnParallelLinear, linear_fc2=ours.TERowParallelLinear))
        refusal = None
    except ValueError as err:
        refusal = str(err)
    parallel_state.destroy_model_parallel()
    return {"types": (_module(fused_spec) is ours.TEFusedMLP, _module(plain_spec) is MLP, type(fused).__name__),
            "keys": (list(fused.state_dict()), list(plain.state_dict())), "outputs": outputs, "refusal": refusal}


def test_te_op_fuser_spec_builds_a_fused_mlp_equal_to_the_plain_mlp():
    """`use_te_op_fuser=True` picks TEFusedMLP: the state dict keys of Megatron's MLP from the same spec and,
    with the same parameters, its output and input gradient bit for bit (TE's fuser computes the unfused MLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    if "use_te_op_fuser" not in inspect.signature(get_gpt_layer_with_transformer_engine_spec).parameters:
        pytest.skip("this megatron-core has no TE operation-fuser spec (0.13 on)")
    result = run_distributed(_fused_and_plain_mlp, 1)[0]
    assert result["types"] == (True, True, "TEFusedMLP")
    assert result["keys"][0] == result["keys"][1]
    for fused, plain in zip(result["outputs"]["fused"], result["outputs"]["plain"]):
        torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    assert "TEFusedMLP expects linear_fc1 to be TELayerNormColumnParallelLinear" in result["refusal"]


def test_bert_and_t5_specs_see_te_and_use_our_modules(patched):
    from megatron.core.models.bert.bert_layer_specs import get_bert_layer_with_transformer_engine_spec
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_transformer_engine_block_spec,
        get_t5_encoder_with_transformer_engine_block_spec,
    )

    from mindspeed_te import megatron as ours

    bert = get_bert_layer_with_transformer_engine_spec().submodules.self_attention.submodules
    assert (bert.linear_qkv, bert.core_attention, bert.linear_proj) == (
        ours.TELayerNormColumnParallelLinear, ours.TEDotProductAttention, ours.TERowParallelLinear)
    encoder = get_t5_encoder_with_transformer_engine_block_spec(2)
    decoder = get_t5_decoder_with_transformer_engine_block_spec(2)
    assert encoder.layer_norm is ours.TENorm and decoder.layer_norm is ours.TENorm
    cross = decoder.layer_specs[0].submodules.cross_attention.submodules
    assert (cross.linear_q, cross.linear_kv, cross.core_attention) == (
        ours.TEColumnParallelLinear, ours.TEColumnParallelLinear, ours.TEDotProductAttention)


def test_revert_gives_megatron_back_its_own_objects():
    """Megatron's TE extension gets its own classes back; where it cannot import without TE (0.12), the
    stand-in module is removed again."""
    try:
        module = importlib.import_module(EXTENSION)
    except ModuleNotFoundError:
        module = None
    before = {name: getattr(module, name) for name in TE_CLASSES} if module is not None else {}
    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    assert importlib.import_module(EXTENSION).TELinear is TE_CLASSES["TELinear"]
    registry.revert()
    assert all(getattr(module, name) is obj for name, obj in before.items())
    if module is None:
        assert EXTENSION not in sys.modules
        with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
            importlib.import_module(EXTENSION)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                  params_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False,
                  gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
                  hidden_dropout=0.0, attention_dropout=0.0)
    kwargs.update(overrides)
    return TransformerConfig(**config_kwargs(**kwargs))


def test_fp8_context_follows_the_config(patched):
    from megatron.core import fp8_utils

    assert isinstance(fp8_utils.get_fp8_context(_config()), nullcontext)
    recipe = fp8_utils.get_fp8_recipe(_config(fp8="hif8", fp8_recipe="tensorwise"))
    assert isinstance(recipe, Float8CurrentScaling) and recipe.fp8_format is Format.HIF8
    with fp8_utils.get_fp8_context(_config(fp8="hybrid", fp8_margin=1, fp8_amax_history_len=8)):
        assert FP8GlobalStateManager.is_fp8_enabled()
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        assert isinstance(recipe, DelayedScaling) and recipe.margin == 1 and recipe.amax_history_len == 8
    assert not FP8GlobalStateManager.is_fp8_enabled()
    # --first-last-layers-bf16: those layers run outside FP8
    config = _config(fp8="e4m3", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                     num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0)
    assert isinstance(fp8_utils.get_fp8_context(config, layer_no=0), nullcontext)
    assert not isinstance(fp8_utils.get_fp8_context(config, layer_no=1), nullcontext)
    with fp8_utils.get_fp8_context(_config(fp8="hif8", fp8_param=True), is_init=True):
        assert FP8GlobalStateManager.with_fp8_parameters()


def _load_shards(model: torch.nn.Module, full: dict, rank: int, world_size: int) -> None:
    """Copy a one-process model's parameters into this tensor-parallel rank's shards (Megatron marks each
    split parameter with `partition_dim`; its QKV rows are grouped per query group, so contiguous chunks
    are the right heads)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[name]
            if getattr(param, "tensor_model_parallel", False):
                value = value.chunk(world_size, dim=param.partition_dim)[rank]
            param.copy_(value)


def _train_gpt(rank: int, world_size: int, fp8: str | None, recipe: str, full: dict | None = None,
               moe: bool = False, backend: str | None = None) -> dict:
    """Two steps of a tiny GPT built from Megatron's TE layer spec (patched) on `world_size` tensor-parallel
    gloo ranks; `full` (a one-process model's parameters) sets the starting point. With `moe`: 4 experts
    (grouped GEMMs, all-to-all dispatcher) and rotary embeddings, which need the CPU device adaptor. With
    `backend`: that kernel backend ("npu" runs torch_npu's kernels through the simulator) and bf16 params."""
    warnings.filterwarnings("ignore")
    if backend is not None:
        import os

        from mindspeed_te.testing import npu_sim

        os.environ["MINDSPEED_TE_BACKEND"] = backend
        os.environ["MINDSPEED_TE_NPU_SIMULATOR"] = "1"
        simulator = npu_sim.make_simulator()  # one simulator for the run, so its launch counts add up
        npu_sim.make_release_simulator = lambda soc_name="Ascend950PR", release="2.14": simulator
    registry = PatchRegistry()
    register_megatron_te(registry)
    if moe:
        register_device_cpu(registry)
    registry.apply()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    parallel_state.initialize_model_parallel(world_size, 1)
    torch.manual_seed(0)
    # MXFP8 experts need their token counts padded to 32 (--moe-router-padding-for-fp8); the others take any
    # (no linear biases: megatron-core 0.15 adds expert biases with the padded token counts under FP8)
    experts = dict(num_moe_experts=4, moe_grouped_gemm=True, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                   add_bias_linear=False,
                   moe_router_padding_for_quantization=fp8 is not None and recipe == "mxfp8") if moe else {}
    precision = dict(params_dtype=torch.bfloat16, bf16=True) if backend is not None else {}
    config = _config(fp8=fp8, fp8_recipe=recipe, tensor_model_parallel_size=world_size, **experts, **precision)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4 if moe else None, moe_grouped_gemm=moe)
    model = GPTModel(config, spec, vocab_size=128, max_sequence_length=32,
                     position_embedding_type="rope" if moe else "learned_absolute")
    if backend is not None:  # bf16 as Megatron trains it: the model wrapped to take and return bf16
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    if full is not None:
        _load_shards(model, full, rank, world_size)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(2, -1)
    mask = torch.ones(2, 1, 32, 32, dtype=torch.bool).tril().logical_not()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        model.set_is_first_microbatch()  # as Megatron's schedules do: the TE linears quantize their weights anew
        loss = model(tokens, positions, mask, labels=tokens).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    module_types = {type(m).__name__ for m in model.modules()}
    scales = [m.fp8_states[0].scale for m in model.modules()
              if getattr(m, "fp8_states", None) and hasattr(m.fp8_states[0], "amax_history")]
    updated = sum(int((scale != 1).sum()) for scale in scales)
    launches = dict(simulator.launch_counts) if backend is not None else {}
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "types": module_types, "updated_scales": updated, "initial": initial,
            "scales": [scale.clone() for scale in scales], "npu_launches": launches}


@pytest.fixture(scope="module")
def baseline():
    return run_distributed(_train_gpt, 1, None, "delayed")[0]


@pytest.mark.parametrize("fp8,recipe", [("hif8", "delayed"), ("e4m3", "tensorwise"), ("hybrid", "mxfp8")])
def test_gpt_trains_in_fp8_with_megatron_te_spec(baseline, fp8, recipe):
    result = run_distributed(_train_gpt, 1, fp8, recipe)[0]
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} <= result["types"]
    losses, base = torch.tensor(result["losses"]), torch.tensor(baseline["losses"])
    assert torch.isfinite(losses).all()
    assert not torch.equal(losses, base)  # the GEMMs really ran quantized
    assert torch.allclose(losses, base, rtol=0.05)  # and close to full precision (8-bit formats)
    assert losses[1] < losses[0]  # it learns
    if recipe == "delayed":
        assert result["updated_scales"] > 0  # delayed scaling recorded amaxes and updated its scales


def test_importing_the_adaptor_applies_the_patches():
    import subprocess
    import sys

    code = ("import warnings; warnings.filterwarnings('ignore'); import mindspeed_te.megatron_adaptor; "
            "import megatron.core.extensions.transformer_engine as te_ext, "
            "megatron.core.models.gpt.gpt_layer_specs as s; "
            "from mindspeed_te.megatron import TELinear; print(te_ext.TELinear is TELinear, s.HAVE_TE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("fp8,recipe", [(None, "delayed"), ("hif8", "delayed"), ("e4m3", "tensorwise")])
def test_tensor_parallel_gpt_matches_one_process(fp8, recipe):
    """TP=2 over gloo, from the same weights as a one-process run: the same losses, and (delayed scaling) the
    same scales on both ranks, because amaxes are MAX-reduced over the tensor-parallel ranks. Tensorwise
    scaling quantizes a row-parallel input per shard (as TransformerEngine does), so it agrees to format
    precision, still far closer than the 2% between FP8 and full precision after a step."""
    single = run_distributed(_train_gpt, 1, fp8, recipe)[0]
    ranks = run_distributed(_train_gpt, 2, fp8, recipe, single["initial"])
    rtol = 1e-3 if recipe == "tensorwise" else 1e-5
    for result in ranks:
        assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(single["losses"]), rtol=rtol)
    if recipe == "delayed" and fp8:
        for a, b in zip(ranks[0]["scales"], ranks[1]["scales"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fp8,recipe", [("hif8", "tensorwise"), ("e4m3", "blockwise")])
def test_moe_gpt_trains_in_fp8_on_cpu(fp8, recipe):
    """Experts as FP8 grouped GEMMs behind Megatron's all-to-all dispatcher, rotary embeddings: the model
    code that calls torch.cuda runs on the CPU adaptor."""
    baseline = run_distributed(_train_gpt, 1, None, "delayed", None, True)[0]
    result = run_distributed(_train_gpt, 1, fp8, recipe, None, True)[0]
    assert {"TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"} <= result["types"]
    losses, base = torch.tensor(result["losses"]), torch.tensor(baseline["losses"])
    assert torch.isfinite(losses).all() and not torch.equal(losses, base)
    assert torch.allclose(losses, base, rtol=0.05) and losses[1] < losses[0]


# Modules that import Megatron's TE extension behind a TE check but are deliberately left alone, and why.
NOT_PATCHED = {
    "megatron.core.models.multimodal.llava_model": "multimodal models",
    "megatron.core.models.retro.decoder_spec": "retro models",
    "megatron.core.post_training.modelopt.layers": "post-training (ModelOpt) layers",
    "megatron.core.transformer.experimental_attention_variant.absorbed_mla": "experimental absorbed MLA (its fused "
                                                                             "RoPE is ours, MLA_ROPE_IMPORTERS)",
    "megatron.core.models.retro.encoder_spec": "retro models",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs": "experimental attention variants",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs": "heterogeneous (NAS) layer specs",
    "megatron.core.transformer.heterogeneous.linear_replacements": "heterogeneous (NAS) layer specs",
    "megatron.core.transformer.moe.shared_experts": "its TE branch only tunes activation saving of TELinear",
    "megatron.core.models.common.language_module.language_module": "optional fused cross entropy; None is fine",
    "megatron.core.models.vision.clip_vit_model": "its import block succeeds; TENorm is rebound",
    "megatron.core.tensor_parallel.random": "imports inside functions, after the patches: gets ours",
    "megatron.core.transformer.cuda_graphs": "imports inside functions, after the patches: gets ours",
}


def _te_gated_importers() -> set[str]:
    """megatron.core modules that import from the TE extension inside a try block or `if HAVE_TE:`."""
    import pathlib

    import megatron.core

    root = pathlib.Path(megatron.core.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            gated = isinstance(node, ast.Try) or (isinstance(node, ast.If) and "HAVE_TE" in ast.unparse(node.test))
            if gated and any(isinstance(n, ast.ImportFrom) and n.module in (EXTENSION, EXTENSION + "_spec_provider")
                             for body in (node.body,) for stmt in body for n in ast.walk(stmt)):
                relative = path.relative_to(root.parent.parent).with_suffix("")
                found.add(".".join(relative.parts))
    return found


def test_every_te_gated_importer_is_patched_or_deliberately_left_alone():
    """A Megatron upgrade that adds an importer fails here until it is classified."""
    found = _te_gated_importers() - {EXTENSION + "_spec_provider"}
    unclassified = found - set(IMPORTERS) - set(NOT_PATCHED)
    assert not unclassified, f"classify these in IMPORTERS or NOT_PATCHED: {sorted(unclassified)}"
    # (an entry that imports nothing from TE in this release may in another: the table serves 0.12 to 0.19)


@pytest.mark.parametrize("fp8,recipe,quantize_kernel,moe", [("hif8", "tensorwise", "npu_dynamic_quant", False),
                                                             ("hif8", "delayed", "npu_quantize", False),
                                                             ("e4m3", "mxfp8", "npu_dynamic_mx_quant_with_dual_axis",
                                                              False),
                                                             # (experts at 64-row pairs: both forms in one call)
                                                             ("e4m3", "mxfp8", "npu_dynamic_mx_quant_with_dual_axis",
                                                              True),
                                                             ("e4m3", "blockwise", "npu_dynamic_mx_quant", True)])
def test_gpt_through_the_npu_kernels_matches_the_reference_backend(fp8, recipe, quantize_kernel, moe):
    """A bf16 GPT from Megatron's spec, its GEMMs and quantizations through torch_npu's kernels (checked
    against their contract by the simulator): the same losses, bit for bit, as the reference backend; with
    `moe`, 4 experts of grouped GEMMs (block-scaled: one GEMM per expert, the experts' rowwise forms from one
    quantize)."""
    if moe and recipe == "mxfp8" and not has_config_field("moe_router_padding_for_quantization"):
        pytest.skip("this megatron-core cannot pad MoE token counts for MXFP8 (0.13 on)")
    npu = run_distributed(_train_gpt, 1, fp8, recipe, None, moe, "npu")[0]
    reference = run_distributed(_train_gpt, 1, fp8, recipe, None, moe, "reference")[0]
    launches = npu["npu_launches"]
    assert launches.get("npu_quant_matmul", 0) > 0 and launches.get(quantize_kernel, 0) > 0, launches
    assert npu["losses"] == reference["losses"]


def test_a_second_full_registry_is_refused_by_name():
    from mindspeed_te.patches import build_registry
    from mindspeed_te.patches.registry import PatchError

    first = build_registry()
    first.apply()
    try:
        with pytest.raises(PatchError, match="another patch registry has already patched it"):
            build_registry().apply()
    finally:
        first.revert()


@pytest.mark.parametrize("recipe,alignment", [(Float8CurrentScaling(fp8_format=Format.HIF8), 16),
                                              (MXFP8BlockScaling(), 32)])
def test_fp8_inference_padding_wraps_the_te_linears(patched, recipe, alignment):
    """Megatron's `prepare_model_for_fp8_inference` (patched to ours) wraps the TE linears named by
    `fp8_utils.TE_LINEAR_TYPES`: under FP8 the layer sees the tokens padded to the GEMM alignment, and the
    caller gets exactly the rows it would get from the layer run on the zero-padded input itself."""
    from megatron.core import fp8_utils

    from mindspeed_te import fp8_autocast
    from mindspeed_te.megatron import TELinear

    layer = TELinear(64, 64, parallel_mode="duplicated", config=_config(), init_method=torch.nn.init.normal_,
                     bias=True, skip_bias_add=False, skip_weight_param_allocation=False, tp_group=None)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model = torch.nn.ModuleDict({"te": layer, "plain": plain})
    unwrapped, plain_forward, seen = layer.forward, plain[0].forward, []

    def recording_forward(inp, *args, **kwargs):  # the layer's own forward, noting how many tokens it gets
        seen.append(inp.shape[0])
        return unwrapped(inp, *args, **kwargs)

    layer.forward = recording_forward
    assert fp8_utils.prepare_model_for_fp8_inference(model) is model
    assert layer in fp8_utils._fp8_inference_wrapped_modules and plain[0].forward == plain_forward
    x = torch.randn(10, 2, 64)
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        padded = torch.cat([x, x.new_zeros(alignment - 10, 2, 64)])
        expected, _ = unwrapped(padded)
        out, _ = layer(x)
    assert seen == [alignment] and out.shape == (10, 2, 64)
    torch.testing.assert_close(out, expected[:10], rtol=0, atol=0)
    with torch.no_grad():  # outside FP8 nothing is padded
        out, _ = layer(x)
    assert seen[-1] == 10


def test_the_fused_moe_and_mla_paths_are_ours(patched):
    """--moe-permute-fusion / --moe-router-fusion find TE's fused MoE functions in moe_utils (mindspeed_te's, with
    HAVE_TE up), so the config accepts permute fusion; MLA's fused YaRN RoPE is ours where the release has it."""
    from megatron.core.transformer.moe import moe_utils

    from mindspeed_te.megatron import mla_rope, moe_fused

    assert moe_utils.HAVE_TE is True
    for name in moe_fused.__all__:
        assert getattr(moe_utils, name) is getattr(moe_fused, name), name
    _config(num_moe_experts=4, moe_permute_fusion=True, add_bias_linear=False)  # checks the fused functions exist
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
        if hasattr(mla, name):  # 0.13 on
            assert getattr(mla, name) is getattr(mla_rope, name), name
