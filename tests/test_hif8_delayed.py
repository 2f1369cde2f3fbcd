"""HIF8DelayedScaling, MindSpeed's `hif8_delayed` recipe (issue 12 item 2): warm-up under current scaling
while the history fills, then delayed scales updated every `scale_update_interval` steps, per-tensor margins,
history length 128; and its Megatron flags, with which Megatron sees its own delayed recipe (issue 29)."""
import dataclasses
import types
import warnings

import pytest
import torch

from mindspeed_te import FP8GlobalStateManager, RecipeState, fp8_autocast
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.megatron.common import recipe_from_config
from mindspeed_te.patches.arguments import wrap_config_from_args
from mindspeed_te.quantizers import Float8CurrentScalingQuantizer
from mindspeed_te.recipe import Format, HIF8DelayedScaling
from tests.test_patches_arguments import _parse


def test_mindspeed_defaults_and_validation():
    r = HIF8DelayedScaling()
    assert (r.fp8_format, r.amax_history_len, r.scale_update_interval, r.amax_collect_interval) == (
        Format.HIF8, 128, 10, 5)
    assert (r.hif8_input_margin, r.hif8_weight_margin, r.hif8_grad_margin) == (11, 12, 11)
    # guard bits below HiF8's largest value 2^15
    assert [r.role_target(role) for role in ("input", "weight", "output", "grad_output")] == [16.0, 8.0, 16.0, 16.0]
    with pytest.raises(ValueError, match="scale_update_interval"):
        HIF8DelayedScaling(scale_update_interval=0)
    with pytest.raises(ValueError, match="hif8_weight_margin"):
        HIF8DelayedScaling(hif8_weight_margin=-1)
    with pytest.raises(ValueError, match="fp8_format"):
        HIF8DelayedScaling(fp8_format=Format.E4M3)
    with pytest.raises(ValueError, match="margin is not used"):
        HIF8DelayedScaling(margin=2)


def test_schedule_warm_up_then_updates_every_interval():
    """Slot 0 (input, target 16) and slot 1 (weight, target 8) over 9 steps with amax = step number, against
    the schedule in closed form: collect 2, interval 3, window 4, amax over the window."""
    recipe = HIF8DelayedScaling(amax_collect_interval=2, scale_update_interval=3, amax_history_len=4)
    state = RecipeState.create(recipe, mode="forward", num_quantizers=3)
    scales, window, scale = [], [], 1.0
    for step in range(1, 10):
        x = torch.full((8,), float(step))
        with fp8_autocast(fp8_recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
            q = state.make_quantizers()
            out = q[0](x)
            q[1](x * 2)
        if step <= 2:  # warm-up: current scaling with the slot's target, independent of the stored scale
            want = Float8CurrentScalingQuantizer(FP8Dtype.HIF8, 16.0)(x)
            assert torch.equal(out.data, want.data) and torch.equal(out.scale_inv, want.scale_inv)
        else:
            assert out.scale_inv.item() == (1.0 / torch.tensor(scale)).item()  # float32 reciprocal
        # closed form of the update at the end of this step
        window.append(step)  # each step's amax; between updates they are max-accumulated
        if step <= 2 or (step - 2) % 3 == 0:
            collected = max(window)
            window = []
            scales.append(collected)
            scale = (torch.tensor(16.0) / max(scales[-4:])).item()  # one float32 division
        assert state.scale[0].item() == scale and state.scale[1].item() == scale / 4  # weight: target 8, amax x2
    assert scales == [1.0, 2.0, 5.0, 8.0] and state.steps == 9


def test_failed_step_reset_restarts_the_warm_up():
    recipe = HIF8DelayedScaling(amax_collect_interval=1)
    state = RecipeState.create(recipe, mode="backward", num_quantizers=2)
    with fp8_autocast(fp8_recipe=recipe):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
        state.make_quantizers()[0](torch.full((4,), 2.0))
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    assert not state.warming_up() and state.scale[0].item() == 8.0  # gradient target 16 / amax 2
    state.reset_amax_history()
    assert state.warming_up() and state.scale.eq(1).all() and state.amax_history.eq(0).all()


def test_megatron_flags_build_the_recipe():
    args = _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--hif8-scale-update-interval", "4",
                   "--hif8-weight-margin", "10", "--hif8-amax-history-len", "64"])
    assert (args.fp8_recipe, args.hif8_delayed) == ("delayed", True)  # what Megatron sees, see below
    config = types.SimpleNamespace(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_wgrad=True,
                                   fp8_amax_compute_algo="max",
                                   **{name: getattr(args, name) for name in vars(args) if name.startswith("hif8_")})
    recipe = recipe_from_config(config)
    assert isinstance(recipe, HIF8DelayedScaling)
    assert (recipe.scale_update_interval, recipe.hif8_weight_margin, recipe.amax_history_len,
            recipe.amax_collect_interval, recipe.hif8_input_margin) == (4, 10, 64, 5, 11)
    with pytest.raises(ValueError, match="--fp8-recipe hif8_delayed needs --fp8-format hif8"):
        _parse(["--fp8-format", "e4m3", "--fp8-recipe", "hif8_delayed"])


def _megatron_config(args, config_class=None, **fields):
    """A TransformerConfig (or `config_class`) from `args` as Megatron's core_transformer_config_from_args makes
    it (every dataclass field the arguments have), wrapped by our hook, which adds our attributes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    def config_from_args(args, config_class=None):
        cls = config_class or TransformerConfig
        copied = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                             params_dtype=torch.float32), **copied, **fields})

    return wrap_config_from_args(config_from_args)(args, config_class)


def test_megatron_config_treats_it_as_delayed():
    """Issue 29: after our parse_args hook Megatron's TransformerConfig holds its own delayed recipe, so Megatron's
    delayed-scaling logic applies (here its own check refusing --first-last-layers-bf16 with delayed scaling), and
    the recipe built from the config is still HIF8DelayedScaling with the --hif8-* settings."""
    pytest.importorskip("megatron.core")
    from megatron.core.enums import Fp8Recipe

    args = _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--hif8-grad-margin", "9"])
    config = _megatron_config(args)
    assert config.fp8_recipe == Fp8Recipe.delayed and config.fp8_recipe == "delayed" and config.hif8_delayed
    recipe = recipe_from_config(config)
    assert isinstance(recipe, HIF8DelayedScaling) and recipe.hif8_grad_margin == 9
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer in BF16"):
        _megatron_config(args, first_last_layers_bf16=True)
    tensorwise = _megatron_config(_parse(["--fp8-format", "hif8", "--fp8-recipe", "tensorwise"]))
    assert tensorwise.fp8_recipe == Fp8Recipe.tensorwise and not tensorwise.hif8_delayed


def test_megatron_core_users_may_name_it_in_the_config():
    """Without megatron.training (no parse_args hook) a TransformerConfig may say fp8_recipe="hif8_delayed"
    (Megatron then treats the run as not delayed), or fp8_recipe="delayed" with `hif8_delayed = True` set on it,
    as the hook does; a hif8_delayed attribute beside another recipe is a contradiction, refused."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    def config(**fields):
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="hif8", **fields)

    assert isinstance(recipe_from_config(config(fp8_recipe="hif8_delayed")), HIF8DelayedScaling)
    marked = config(fp8_recipe="delayed")
    marked.hif8_delayed = True
    assert isinstance(recipe_from_config(marked), HIF8DelayedScaling)
    marked.fp8_recipe = "tensorwise"
    with pytest.raises(ValueError, match="config.hif8_delayed .* needs config.fp8_recipe 'delayed', got 'tensorwise'"):
        recipe_from_config(marked)


def _mla_linear_proj(rank: int, world_size: int, argvs: list[list[str]]) -> dict:
    """Per argument list: whether Megatron's MLA (patched TE spec, its own attention code) set save_original_input
    on linear_proj, and the recipe megatron.core.fp8_utils.get_fp8_recipe returns."""
    warnings.filterwarnings("ignore")
    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    register_device_cpu(registry)
    registry.apply()  # before Megatron's modules are imported, as the adaptor does
    from megatron.core import fp8_utils, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    parallel_state.initialize_model_parallel(1, 1)
    spec = get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
    results = {}
    for argv in argvs:
        config = _megatron_config(_parse(argv), MLATransformerConfig, apply_rope_fusion=False, q_lora_rank=32,
                                  kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)
        attention = TransformerLayer(config, spec.submodules).self_attention
        results[argv[-1]] = (type(attention).__name__, attention.linear_proj.save_original_input,
                             type(fp8_utils.get_fp8_recipe(config)).__name__)
    return results


def test_megatron_mla_treats_it_as_delayed():
    """The issue's symptom: Megatron's attention (megatron-core 0.14 on) sets save_original_input on MLA's
    linear_proj for non-delayed FP8 recipes only (TE refuses it with delayed scaling); hif8_delayed must be
    treated as delayed, as `--fp8-recipe delayed` is."""
    megatron_core = pytest.importorskip("megatron.core")
    from packaging.version import Version

    from tests.dist_utils import run_distributed

    argvs = [["--fp8-format", "hif8", "--fp8-recipe", name] for name in ("hif8_delayed", "delayed", "tensorwise")]
    (results,) = run_distributed(_mla_linear_proj, 1, argvs)
    sets_it = Version(megatron_core.__version__) >= Version("0.14")
    assert results == {"hif8_delayed": ("MLASelfAttention", False, "HIF8DelayedScaling"),
                       "delayed": ("MLASelfAttention", False, "DelayedScaling"),
                       "tensorwise": ("MLASelfAttention", sets_it, "Float8CurrentScaling")}


def test_bad_interval_fails_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--hif8-scale-update-interval", "0"])
    assert "--hif8-scale-update-interval must be >= 1, got 0" in capsys.readouterr().err


def _train(backend, use_backend):
    from mindspeed_te.modules import Linear

    use_backend(backend)
    torch.manual_seed(0)
    layer = Linear(64, 64, params_dtype=torch.bfloat16)
    recipe = HIF8DelayedScaling(amax_collect_interval=2, scale_update_interval=2)
    outputs = []
    for step in range(7):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).bfloat16().requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()
        outputs.append((y.detach(), x.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
    return outputs, layer


def test_a_linear_trains_with_it_identically_on_the_npu_kernels(use_backend):
    reference, layer = _train("reference", use_backend)
    npu, _ = _train("npu", use_backend)
    for a, b in zip(reference, npu):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    fwd, bwd = layer.fp8_states
    assert fwd.steps == bwd.steps == 7 and torch.isfinite(fwd.scale).all() and fwd.scale[0].item() != 1.0
