"""LayerNormLinear: TE's parameter names and return conventions, equality with a norm followed by `Linear`
(high precision and every FP8 recipe), column tensor/sequence parallelism on real gloo groups, and errors."""
import pytest
import torch

from mindspeed_te import FP8GlobalStateManager, fp8_autocast
from mindspeed_te.modules.layernorm_linear import LayerNormLinear
from mindspeed_te.modules.linear import Linear
from mindspeed_te.modules.norm import LayerNorm, RMSNorm
from tests.dist_utils import run_distributed
from tests.test_linear_parallel import RECIPES  # the same recipe table as Linear's parity tests

NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
STEPS = 2  # the second step runs delayed scaling with the scales the first one produced


def _params(hidden_in: int, hidden_out: int, normalization: str, zero_centered: bool) -> dict:
    """Full-size parameters: a non-trivial norm (gamma around 1) and a linear."""
    g = torch.Generator().manual_seed(7)
    gamma = torch.randn(hidden_in, generator=g) * 0.2
    params = {
        "layer_norm_weight": gamma if zero_centered else gamma + 1,
        "weight": torch.randn(hidden_out, hidden_in, generator=g) * 0.05,
        "bias": torch.randn(hidden_out, generator=g),
    }
    if normalization == "LayerNorm":
        params["layer_norm_bias"] = torch.randn(hidden_in, generator=g) * 0.1
    return params


def _data(step: int, seq: int, batch: int, hidden_in: int, hidden_out: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(seq, batch, hidden_in, generator=g) * 3 + 1
    dy = torch.randn(seq, batch, hidden_out, generator=g) * 0.1
    return x, dy


class _NormThenLinear(torch.nn.Module):
    """The unfused composition LayerNormLinear must equal, with the same parameters."""

    def __init__(self, hidden_in: int, hidden_out: int, normalization: str, zero_centered: bool) -> None:
        super().__init__()
        self.norm = NORMS[normalization](hidden_in, zero_centered_gamma=zero_centered)
        self.linear = Linear(hidden_in, hidden_out)
        params = _params(hidden_in, hidden_out, normalization, zero_centered)
        with torch.no_grad():
            self.norm.weight.copy_(params["layer_norm_weight"])
            if normalization == "LayerNorm":
                self.norm.bias.copy_(params["layer_norm_bias"])
            self.linear.weight.copy_(params["weight"])
            self.linear.bias.copy_(params["bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))

    def grads(self) -> dict:
        grads = {"layer_norm_weight": self.norm.weight.grad, "weight": self.linear.weight.grad,
                 "bias": self.linear.bias.grad}
        if isinstance(self.norm, LayerNorm):
            grads["layer_norm_bias"] = self.norm.bias.grad
        return grads


def _fused(hidden_in: int, hidden_out: int, normalization: str, zero_centered: bool, **kwargs) -> LayerNormLinear:
    layer = LayerNormLinear(hidden_in, hidden_out, normalization=normalization, zero_centered_gamma=zero_centered,
                            **kwargs)
    with torch.no_grad():
        for name, value in _params(hidden_in, hidden_out, normalization, zero_centered).items():
            getattr(layer, name).copy_(value)
    return layer


def _train(model: torch.nn.Module, recipe_name: str, shard_x, shard_dy, group=None,
           sizes=(16, 2, 128, 256)) -> dict:
    """STEPS forward/backward steps; output, input gradient and parameter gradients of the last one."""
    FP8GlobalStateManager.reset()
    make = RECIPES[recipe_name]
    result = {}
    for step in range(STEPS):
        x_full, dy_full = _data(step, *sizes)
        x = shard_x(x_full).clone().requires_grad_()
        model.zero_grad()
        with fp8_autocast(enabled=make is not None, fp8_recipe=make() if make else None, fp8_group=group):
            y = model(x)
        y.backward(shard_dy(dy_full))
        grads = model.grads() if isinstance(model, _NormThenLinear) else {
            name: p.grad for name, p in model.named_parameters()}
        result = {"y": y.detach(), "dx": x.grad, **grads}
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Single process --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("normalization,zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_equals_norm_then_linear(recipe_name, normalization, zero_centered):
    """Same operations on the same values: equal bit for bit, in high precision and in every FP8 recipe."""
    ident = lambda t: t  # noqa: E731
    fused = _train(_fused(128, 256, normalization, zero_centered), recipe_name, ident, ident)
    unfused = _train(_NormThenLinear(128, 256, normalization, zero_centered), recipe_name, ident, ident)
    assert fused.keys() == unfused.keys()
    for name, value in unfused.items():
        assert torch.equal(fused[name], value), f"{recipe_name} {normalization}: {name} differs"
    if RECIPES[recipe_name] is not None:  # the FP8 GEMMs really ran
        high = _train(_NormThenLinear(128, 256, normalization, zero_centered), "high precision", ident, ident)
        assert 0 < _rel(fused["y"], high["y"]) < 0.1


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_parameter_names_order_and_initial_values(normalization):
    layer = LayerNormLinear(64, 32, normalization=normalization, params_dtype=torch.bfloat16)
    norm_names = ["layer_norm_weight", "layer_norm_bias"] if normalization == "LayerNorm" else ["layer_norm_weight"]
    assert [name for name, _ in layer.named_parameters()] == [*norm_names, "weight", "bias"]
    assert list(layer.state_dict()) == [*norm_names, "weight", "bias", "_extra_state"]
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    assert torch.equal(layer.layer_norm_weight, torch.ones(64, dtype=torch.bfloat16))
    if normalization == "LayerNorm":
        assert torch.equal(layer.layer_norm_bias, torch.zeros(64, dtype=torch.bfloat16))
    centered = LayerNormLinear(64, 32, normalization=normalization, zero_centered_gamma=True, bias=False)
    assert torch.equal(centered.layer_norm_weight, torch.zeros(64))
    assert [name for name, _ in centered.named_parameters()] == [*norm_names, "weight"]


def test_sequence_parallel_attribute_on_norm_parameters():
    """Only a column-parallel layer receives a sequence-split input, so only then are its norm gradients
    partial sums that Megatron must all-reduce."""
    column = LayerNormLinear(64, 32, parallel_mode="column", sequence_parallel=True)
    assert column.layer_norm_weight.sequence_parallel and column.layer_norm_bias.sequence_parallel
    plain = LayerNormLinear(64, 32, parallel_mode=None, sequence_parallel=True)
    assert not plain.layer_norm_weight.sequence_parallel and not plain.layer_norm_bias.sequence_parallel
    assert column.weight.tensor_model_parallel and column.weight.partition_dim == 0


def test_return_conventions():
    x = torch.randn(4, 2, 64)
    ref = _fused(64, 32, "LayerNorm", False)
    out = ref(x)
    norm = LayerNorm(64)
    with torch.no_grad():
        norm.weight.copy_(ref.layer_norm_weight)
        norm.bias.copy_(ref.layer_norm_bias)
    ln_out = norm(x)

    layer = _fused(64, 32, "LayerNorm", False, return_layernorm_output=True)
    y, ln = layer(x)
    assert torch.equal(y, out) and torch.equal(ln, ln_out)

    layer = _fused(64, 32, "LayerNorm", False, return_bias=True)
    y, bias = layer(x)
    assert bias is layer.bias and torch.equal(y + bias, out)

    layer = _fused(64, 32, "LayerNorm", False, return_bias=True, return_layernorm_output=True)
    y, bias, ln = layer(x)
    assert bias is layer.bias and torch.equal(y + bias, out) and torch.equal(ln, ln_out)


def test_norm_output_gradient_reaches_the_norm():
    """A consumer of the returned norm output (e.g. a residual) adds its gradient to the linear's."""
    x = torch.randn(4, 2, 64, requires_grad=True)
    layer = _fused(64, 32, "RMSNorm", False, return_layernorm_output=True)
    y, ln = layer(x)
    (y.sum() + ln.sum()).backward()
    x2 = x.detach().clone().requires_grad_()
    unfused = _NormThenLinear(64, 32, "RMSNorm", False)
    ln2 = unfused.norm(x2)
    (unfused.linear(ln2).sum() + ln2.sum()).backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(layer.layer_norm_weight.grad, unfused.norm.weight.grad)


def test_fused_wgrad_accumulation_adds_into_main_grad():
    layer = _fused(64, 32, "LayerNorm", False, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.ones_like(layer.weight)
    layer.weight.grad_added_to_main_grad = False  # as Megatron's DDP marks its parameters
    x = torch.randn(8, 64)
    layer(x).sum().backward()
    assert layer.weight.grad.shape == layer.weight.shape and layer.weight.grad_added_to_main_grad
    unfused = _NormThenLinear(64, 32, "LayerNorm", False)
    unfused(x).sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, 1 + unfused.linear.weight.grad)


def test_bad_arguments_name_the_argument_and_allowed_values():
    with pytest.raises(ValueError, match=r"normalization must be 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"):
        LayerNormLinear(64, 32, normalization="BatchNorm")
    with pytest.raises(ValueError, match=r"parallel_mode must be None or 'column', got 'row'"):
        LayerNormLinear(64, 32, parallel_mode="row")
    with pytest.raises(ValueError, match=r"parallel_mode must be None or 'column', got 'columns'"):
        LayerNormLinear(64, 32, parallel_mode="columns")


# Tensor and sequence parallelism on gloo groups -----------------------------------------------------------

# 512 outputs leave 128 per rank on 4 ranks: blockwise 128x128 weight tiles line up with the shards, so it,
# delayed scaling (amaxes reduced over the group) and high precision match one process to fp32 rounding.
DIST_SIZES = (16, 2, 256, 512)
DIST_RECIPES = ("high precision", "delayed/hybrid", "blockwise/e4m3")
DIST_CASES = [(norm, sp) for norm in ("LayerNorm", "RMSNorm") for sp in (False, True)]


def _dist_shards(sp: bool, rank: int, world: int):
    """Cut the full input / output gradient / parameters down to this rank's part (column parallel)."""
    seq = (lambda t: t.chunk(world, dim=0)[rank]) if sp else (lambda t: t)
    last = lambda t: t.chunk(world, dim=-1)[rank]  # noqa: E731
    return seq, last


def _dist_worker(rank: int, world: int) -> dict:
    group = torch.distributed.new_group(list(range(world)))
    results = {}
    for recipe_name in DIST_RECIPES:
        for normalization, sp in DIST_CASES:
            zero_centered = normalization == "RMSNorm"
            layer = LayerNormLinear(DIST_SIZES[2], DIST_SIZES[3], normalization=normalization,
                                    zero_centered_gamma=zero_centered, parallel_mode="column",
                                    sequence_parallel=sp, tp_group=group)
            with torch.no_grad():
                for name, value in _params(*DIST_SIZES[2:], normalization, zero_centered).items():
                    getattr(layer, name).copy_(value if name.startswith("layer_norm") else value.chunk(world)[rank])
            seq, last = _dist_shards(sp, rank, world)
            results[(recipe_name, normalization, sp)] = _train(layer, recipe_name, seq, last, group, DIST_SIZES)
    return results


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_column_parallel_matches_single_process(world):
    results = run_distributed(_dist_worker, world)
    ident = lambda t: t  # noqa: E731
    for recipe_name in DIST_RECIPES:
        for normalization, sp in DIST_CASES:
            zero_centered = normalization == "RMSNorm"
            ref = _train(_fused(*DIST_SIZES[2:], normalization, zero_centered), recipe_name, ident, ident,
                         sizes=DIST_SIZES)
            key = (recipe_name, normalization, sp)
            for rank, res in enumerate(results):
                seq, last = _dist_shards(sp, rank, world)
                got = dict(res[key])
                expect = {"y": last(ref["y"]), "dx": seq(ref["dx"]),
                          "weight": ref["weight"].chunk(world)[rank], "bias": ref["bias"].chunk(world)[rank]}
                for name in ("layer_norm_weight", "layer_norm_bias"):
                    if name in ref:
                        expect[name] = ref[name]
                        if sp:
                            # Each rank normalized its slice of the sequence: a partial sum, which Megatron
                            # all-reduces because the parameter is marked sequence_parallel.
                            got[name] = sum(r[key][name] for r in results)
                for name, value in expect.items():
                    err = _rel(got[name], value)
                    assert err <= 2e-6, f"{recipe_name} {normalization} sp={sp} rank={rank} {name}: {err:.2e}"
