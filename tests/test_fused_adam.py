"""mindspeed_te.optimizers.FusedAdam, TransformerEngine's precision-aware Adam: float32 states give torch's
AdamW bit for bit; low-precision moments stay within the rounding bound of their format around a float64
reference step; the master as bf16 parameter + int16 remainder is the float32 master bit for bit; state dicts
and get_unscaled_state / set_scaled_state round trips are exact; bad keywords are refused by name; the update
runs a fixed number of torch ops per group, whatever the number of parameters.

Megatron-core's distributed optimizer with --use-precision-aware-optimizer (patches/precision_optimizer.py):
the config check passes where TE's would, and a torch_dist checkpoint resumes bit for bit."""
from __future__ import annotations

import io
import math
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_te.optimizers import FusedAdam, FusedAdamConfigError
from mindspeed_te.optimizers.states import MX_BLOCK, join_remainders, split_remainders

SHAPES = [(7, 5), (33,), (4, 4, 3), (65,)]
LOW = ["bf16", "fp16", "fp8", "hif8", "mxfp8"]
LR, BETAS, WD = 1e-2, (0.9, 0.999), 0.1


def _params(dtype=torch.float32, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, dtype=None, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    # a wide spread of magnitudes, as real gradients have
    return [(torch.randn(p.shape, generator=g) * scale * torch.exp(2 * torch.randn(p.shape, generator=g)))
            .to(dtype or p.dtype) for p in params]


def _set_grads(params, grads, decoupled=False):
    for p, g in zip(params, grads):
        if decoupled:
            p.decoupled_grad = g.clone()
        else:
            p.grad = g.clone()


# float32: torch's AdamW, bit for bit ---------------------------------------------------------------------
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, WD])
def test_fp32_states_match_torch_adam_bit_for_bit(adam_w_mode, weight_decay):
    ours, theirs = _params(), _params()
    opt = FusedAdam(ours, lr=LR, betas=BETAS, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = torch_cls(theirs, lr=LR, betas=BETAS, weight_decay=weight_decay, foreach=False, fused=False)
    for step in range(6):
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        _set_grads(theirs, grads)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][name], ref.state[b][name])
    assert all(group["step"] == 6 for group in opt.param_groups)


# Low-precision moments: the rounding bound of each format ----------------------------------------------
def _half_spacing(fmt: str, y: torch.Tensor) -> torch.Tensor:
    """Half the distance between neighbouring values of the format at magnitude y (float64, >= 0): the
    largest rounding error there (an independent statement of each format's value set)."""
    e = torch.floor(torch.log2(y.clamp(min=2.0 ** -160)))
    if fmt in ("fp8", "mxfp8"):  # E4M3: 3 mantissa bits, subnormals spaced 2^-9 below 2^-6
        return torch.where(y < 2.0 ** -6, 2.0 ** -10, 2.0 ** (e - 4))
    if fmt == "fp16":
        return torch.where(y < 2.0 ** -14, 2.0 ** -25, 2.0 ** (e - 11))
    if fmt == "bf16":
        return 2.0 ** (e - 8)
    if fmt == "hif8":  # 3 mantissa bits for |E| <= 3, 2 up to 7, 1 up to 15; powers of two 2^-22..2^-16
        bits = torch.where(e.abs() <= 3, 3.0, torch.where(e.abs() <= 7, 2.0, 1.0))
        normal = 2.0 ** (e - bits - 1)
        return torch.where(e >= -15, normal, torch.where(e >= -22, 2.0 ** (e - 1), 2.0 ** -23))
    raise AssertionError(fmt)


def _scales(opt, p, name, fmt):
    """Per element, the float64 scale that multiplies the stored value."""
    if fmt == "bf16":
        return torch.ones(p.shape, dtype=torch.float64)
    scale = opt._scales[p][name]
    if fmt == "mxfp8":
        per_block = torch.pow(2.0, scale.double() - 127)
        return per_block.repeat_interleave(MX_BLOCK)[:p.numel()].view(p.shape)
    return scale.double().expand(p.shape)


TARGETS = {"fp16": 2.0 ** 15, "fp8": 448.0, "mxfp8": 448.0, "hif8": 8.0}


@pytest.mark.parametrize("fmt", LOW)
def test_low_precision_moments_stay_within_the_rounding_bound_of_a_float64_step(fmt):
    params = _params()
    opt = FusedAdam(params, lr=LR, betas=BETAS, weight_decay=WD, exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt)
    beta1, beta2 = BETAS
    for step in range(4):
        grads = _grads(params, step, scale=1e-3)
        before = [p.detach().clone() for p in params]
        prev = {name: [opt.get_unscaled_state(p, name).clone() if opt.state[p] else torch.zeros_like(p)
                       for p in params] for name in ("exp_avg", "exp_avg_sq")}
        _set_grads(params, grads)
        opt.step()
        # The parameters: torch's float32 AdamW step from the same (dequantized) moments, bit for bit.
        for p, p0, g, m0, v0 in zip(params, before, grads, prev["exp_avg"], prev["exp_avg_sq"]):
            q = torch.nn.Parameter(p0.clone())
            ref = torch.optim.AdamW([q], lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
            ref.state[q] = {"step": torch.tensor(float(step)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
            q.grad = g.clone()
            ref.step()
            assert torch.equal(p, q)
        # The moments: within the format's rounding bound of the float64 moments (plus float32's own error).
        for name, beta, new in (("exp_avg", beta1, lambda g: g), ("exp_avg_sq", beta2, lambda g: g * g)):
            for p, g, old in zip(params, grads, prev[name]):
                old, g = old.double(), g.double()
                exact = beta * old + (1 - beta) * new(g)
                stored = opt.get_unscaled_state(p, name).double()
                scale = _scales(opt, p, name, fmt)
                bound = _half_spacing(fmt, exact.abs() / scale * (1 + 2.0 ** -20)) * scale
                slack = 2.0 ** -21 * (beta * old.abs() + (1 - beta) * new(g).abs())
                assert ((stored - exact).abs() <= bound + slack).all(), (name, step)
                if fmt in TARGETS:  # the smallest power-of-two scale that holds the largest magnitude
                    assert torch.equal(scale, torch.pow(2.0, torch.round(torch.log2(scale))))
                    blocks = exact.abs() if fmt != "mxfp8" else None
                    if blocks is not None:
                        amax = blocks.max() * (1 - 2.0 ** -20)
                        assert amax <= TARGETS[fmt] * scale.flatten()[0] * (1 + 2.0 ** -20)
                        assert amax > TARGETS[fmt] * scale.flatten()[0] / 2


def test_8bit_moments_take_one_byte_per_element_and_te_names():
    p = _params(shapes=[(256,)])
    opt = FusedAdam(p, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype="mxfp8")
    assert opt.exp_avg_dtype is torch.uint8 and opt.formats["exp_avg"].name == "e4m3"
    p[0].grad = torch.randn(256)
    opt.step()
    state = opt.state[p[0]]
    assert state["exp_avg"].element_size() == 1 and state["exp_avg_sq"].element_size() == 1
    assert opt._scales[p[0]]["exp_avg"].shape == (1,) and opt._scales[p[0]]["exp_avg"].dtype == torch.float32
    assert opt._scales[p[0]]["exp_avg_sq"].shape == (256 // MX_BLOCK,)  # one E8M0 byte per 32 elements


# Master weights ------------------------------------------------------------------------------------------
def test_bf16_parameters_follow_their_fp32_master():
    params = _params(torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = FusedAdam(params, lr=LR, weight_decay=WD, master_weights=True, use_decoupled_grad=True,
                    exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    ref = FusedAdam(masters, lr=LR, weight_decay=WD, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for step in range(4):
        grads = _grads(params, step)  # bf16, as Megatron's --main-grads-dtype bf16
        _set_grads(params, grads, decoupled=True)
        _set_grads(masters, [g.float() for g in grads])
        opt.step()
        ref.step()
    for p, m in zip(params, masters):
        assert torch.equal(opt.get_unscaled_state(p, "master_param"), m)
        assert torch.equal(p, m.to(torch.bfloat16))


def test_fp16_master_weights_round_the_fp32_master():
    params = _params(torch.bfloat16)
    opt = FusedAdam(params, lr=LR, master_weights=True, master_weight_dtype=torch.float16)
    for step in range(3):
        _set_grads(params, _grads(params, step))
        opt.step()
    for p in params:
        assert opt.state[p]["master_param"].dtype == torch.float16
        master = opt.get_unscaled_state(p, "master_param").double()
        scale = opt._scales[p]["master_param"].double()
        assert ((master - p.double()).abs() <= _half_spacing("bf16", p.double().abs()) +
                _half_spacing("fp16", master.abs() / scale) * scale).all()


def _te_bf16_rounding(bits: torch.Tensor) -> torch.Tensor:
    """TransformerEngine's bf16 parameter of a float32 master (bits as int64): the top 16 bits, plus one when
    the low 16 bits are 0x8000 or more."""
    return ((bits >> 16) + ((bits & 0xFFFF) >= 0x8000).long()) & 0xFFFF


def test_remainders_split_and_join_every_float32_bit_pattern_exactly():
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 2 ** 32, (1 << 20,), generator=g, dtype=torch.int64)
    edges = torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFF8000, 0xFFFF8000, 0x7FFFFFFF,
                          0xFFFFFFFF, 0x00008000, 0x80008000, 0x3F807FFF, 0x3F808000, 0x3F80FFFF])
    bits = torch.cat([bits, edges])
    masters = (bits - ((bits >= 2 ** 31).long() << 32)).to(torch.int32).view(torch.float32)
    params, rems = torch.empty(bits.shape, dtype=torch.bfloat16), torch.empty(bits.shape, dtype=torch.int16)
    split_remainders([masters], [params], [rems])
    assert torch.equal(params.view(torch.int16).long() & 0xFFFF, _te_bf16_rounding(bits))
    assert torch.equal(rems.long() & 0xFFFF, bits & 0xFFFF)
    assert torch.equal(join_remainders([params], [rems])[0].view(torch.int32), masters.view(torch.int32))


def test_store_param_remainders_keeps_the_fp32_master_bit_for_bit():
    params, twins = _params(torch.bfloat16), _params(torch.bfloat16)
    kwargs = dict(lr=LR, weight_decay=WD, master_weights=True, exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16")
    opt = FusedAdam(params, store_param_remainders=True, **kwargs)
    ref = FusedAdam(twins, **kwargs)
    for step in range(5):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(twins, grads)
        opt.step()
        ref.step()
    for p, t in zip(params, twins):
        rem = opt.get_unscaled_state(p, "master_param")
        assert rem.dtype == torch.int16  # 2 bytes kept per parameter instead of 4
        master = join_remainders([p.detach()], [rem])[0]
        assert torch.equal(master.view(torch.int32), ref.state[t]["master_param"].view(torch.int32))
        bits = master.view(torch.int32).long() & 0xFFFFFFFF
        assert torch.equal(p.detach().view(torch.int16).long() & 0xFFFF, _te_bf16_rounding(bits))


# Round trips ---------------------------------------------------------------------------------------------
CONFIGS = [dict(exp_avg_dtype=f, exp_avg_sq_dtype=f) for f in ["fp32", *LOW]] + [
    dict(dtype=torch.bfloat16, master_weights=True, store_param_remainders=True, exp_avg_dtype=torch.uint8,
         exp_avg_sq_dtype=torch.uint8),
    dict(dtype=torch.bfloat16, master_weights=True, master_weight_dtype=torch.float16, exp_avg_dtype="hif8",
         exp_avg_sq_dtype="fp16"),
]


def _trained(config, seed=0, steps=3):
    config = dict(config)
    params = _params(config.pop("dtype", torch.float32), seed)
    opt = FusedAdam(params, lr=LR, weight_decay=WD, **config)
    for step in range(steps):
        _set_grads(params, _grads(params, step, scale=1e-2))
        opt.step()
    return params, opt, config


def _same_state(opt_a, pa, opt_b, pb, raw=True):
    """The same parameters and state values; with `raw`, the same stored codes and scales too (a load may
    store a value as twice the code with half the scale, see test_a_largest_value_of_half_the_target...)."""
    for a, b in zip(pa, pb):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
        assert opt_a.state[a].keys() == opt_b.state[b].keys()
        for name in opt_a.state[a]:
            assert torch.equal(opt_a.get_unscaled_state(a, name), opt_b.get_unscaled_state(b, name)), name
        if not raw:
            continue
        for name, value in opt_a.state[a].items():
            other = opt_b.state[b][name]
            assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                               other.view(torch.uint8) if other.element_size() == 1 else other), name
        for name, scale in opt_a._scales.get(a, {}).items():
            assert torch.equal(scale, opt_b._scales[b][name]), name


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c.values()))
def test_state_dict_round_trip_resumes_exactly(config):
    params, opt, kwargs = _trained(config)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    for state in saved["state"].values():  # TE's format: float32 values (int16 remainders)
        for name, value in state.items():
            assert value.dtype in (torch.float32, torch.int16), (name, value.dtype)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = FusedAdam(copies, lr=1.0, **kwargs)  # lr, betas, step ... come from the state dict
    resumed.load_state_dict(saved)
    _same_state(opt, params, resumed, copies, raw=False)
    grads = _grads(params, 99, scale=1e-2)
    _set_grads(params, grads)
    _set_grads(copies, grads)
    opt.step()
    resumed.step()
    _same_state(opt, params, resumed, copies)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c.values()))
def test_unscaled_states_store_back_to_themselves(config):
    """Megatron's checkpoints hold get_unscaled_state's values and load them through set_scaled_state."""
    params, opt, _ = _trained(config)
    for p in params:
        for name in list(opt.state[p]):
            value = opt.get_unscaled_state(p, name).clone()
            opt.set_scaled_state(p, name, value)
            assert torch.equal(opt.get_unscaled_state(p, name), value), name


@pytest.mark.parametrize("fmt", ["fp16", "fp8", "hif8", "mxfp8"])
def test_a_largest_value_of_half_the_target_quantizes_back_exactly(fmt):
    """The one case where the scale changes on a round trip (the largest stored magnitude is exactly half the
    target: the scale halves, every code doubles)."""
    p = torch.nn.Parameter(torch.zeros(64))
    opt = FusedAdam([p], exp_avg_dtype=fmt)
    target = {"fp16": 2.0 ** 15, "fp8": 448.0, "hif8": 8.0, "mxfp8": 448.0}[fmt]
    g = torch.Generator().manual_seed(3)
    values = (torch.randn(64, generator=g) * target / 16).clamp(-target / 2, target / 2) * 2.0 ** -7
    values[::MX_BLOCK] = target / 2 * 2.0 ** -7
    opt.set_scaled_state(p, "exp_avg", values)
    stored = opt.get_unscaled_state(p, "exp_avg").clone()
    opt.set_scaled_state(p, "exp_avg", stored)
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), stored)


# Keywords ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(exp_avg_dtype=torch.int8), "exp_avg_dtype"),
    (dict(exp_avg_sq_dtype="fp4"), "exp_avg_sq_dtype"),
    (dict(master_weights=True, master_weight_dtype=torch.bfloat16), "master_weight_dtype"),
    (dict(master_weights=True, master_weight_dtype="fp8"), "master_weight_dtype"),
    (dict(capturable=True, master_weights=True, master_weight_dtype=torch.float16), "master_weight_dtype"),
    (dict(capturable=True, exp_avg_dtype=torch.uint8), "exp_avg_dtype"),
    (dict(capturable=True, master_weights=True, store_param_remainders=True), "store_param_remainders"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(lr=-1.0), "lr"),
    (dict(eps=-1e-8), "eps"),
])
def test_bad_keywords_are_refused_by_name(kwargs, named):
    with pytest.raises(FusedAdamConfigError, match=named):
        FusedAdam(_params(), **kwargs)
    with pytest.raises(RuntimeError):  # TransformerEngine raises RuntimeError
        FusedAdam(_params(), **kwargs)


def test_an_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="adam_mode"):
        FusedAdam(_params(), adam_mode=True)


def test_quantized_parameters_need_master_weights_and_are_requantized_from_them():
    from mindspeed_te.modules import Linear
    from mindspeed_te.quantized_tensor import QuantizedTensor
    from mindspeed_te.recipe import Float8CurrentScaling
    from mindspeed_te.state import fp8_model_init

    with fp8_model_init(recipe=Float8CurrentScaling()):
        layer = Linear(64, 32, params_dtype=torch.bfloat16, bias=False)
    weight = layer.weight
    assert isinstance(weight, QuantizedTensor)
    weight.grad = torch.randn(32, 64).bfloat16()
    with pytest.raises(FusedAdamConfigError, match="master_weights"):
        FusedAdam([weight]).step()
    opt = FusedAdam([weight], lr=LR, master_weights=True, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8")
    start = weight.dequantize(dtype=torch.float32).clone()
    opt.step()
    master = opt.get_unscaled_state(weight, "master_param")
    assert not torch.equal(master, start)
    assert torch.equal(weight.dequantize(), weight._quantizer.quantize(master.bfloat16()).dequantize(torch.bfloat16))


def test_decoupled_grads_and_zero_grad():
    params = _params(torch.bfloat16)
    opt = FusedAdam(params, lr=LR, master_weights=True, use_decoupled_grad=True)
    start = [p.detach().clone() for p in params]
    _set_grads(params, _grads(params, 0))  # .grad is not what this optimizer reads
    opt.step()
    assert all(torch.equal(p, s) for p, s in zip(params, start))
    _set_grads(params, _grads(params, 0), decoupled=True)
    opt.step()
    assert not any(torch.equal(p, s) for p, s in zip(params, start))
    opt.zero_grad(set_to_none=False)
    assert all(not p.decoupled_grad.any() for p in params)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in params)


def test_capturable_keeps_lr_and_step_as_tensors_and_agrees():
    host, graph = _params(), _params()
    opt = FusedAdam(host, lr=LR, weight_decay=WD, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    cap = FusedAdam(graph, lr=LR, weight_decay=WD, capturable=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    for step in range(3):
        grads = _grads(host, step)
        _set_grads(host, grads)
        _set_grads(graph, grads)
        opt.step()
        cap.step()
    assert isinstance(cap.param_groups[0]["lr"], torch.Tensor) and int(cap.param_groups[0]["step"]) == 3
    for a, b in zip(host, graph):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # step size from float32 tensors, not doubles


# Vectorised: the ops per step do not grow with the number of parameters ---------------------------------
_FACTORIES = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full"}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _FACTORIES and not name.startswith(("detach", "view", "_unsafe_view", "alias", "lift")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config", [
    dict(),
    dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    dict(dtype=torch.bfloat16, master_weights=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="fp16",
         use_decoupled_grad=True),
    dict(dtype=torch.bfloat16, master_weights=True, store_param_remainders=True, exp_avg_dtype=torch.uint8,
         exp_avg_sq_dtype=torch.bfloat16, use_decoupled_grad=True),
], ids=["fp32", "fp8-moments", "bf16-params-fp32-master", "bf16-params-remainders"])
def test_torch_ops_per_step_do_not_grow_with_the_parameters(config):
    counts = {}
    for n in (3, 12):
        kwargs = dict(config)
        dtype = kwargs.pop("dtype", torch.float32)
        params = _params(dtype, shapes=[(16, 8)] * n)
        opt = FusedAdam(params, lr=LR, weight_decay=WD, **kwargs)
        for step in range(2):
            _set_grads(params, _grads(params, step), decoupled=kwargs.get("use_decoupled_grad", False))
            with _OpCounter() as counter:
                opt.step()
        counts[n] = counter.ops
    assert counts[3] == counts[12], (len(counts[3]), len(counts[12]))
    assert sum(op.startswith("_foreach") for op in counts[3]) >= 8  # the Adam update's 8 foreach ops


# Megatron-core: the distributed optimizer with --use-precision-aware-optimizer ---------------------------
_CONFIG_CHECK = textwrap.dedent("""
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    from megatron.core.optimizer import OptimizerConfig
    kwargs = dict(optimizer="adam", use_distributed_optimizer=True, bf16=True, use_precision_aware_optimizer=True,
                  exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, main_grads_dtype=torch.bfloat16)
    try:
        OptimizerConfig(**kwargs)
    except Exception as error:  # without TE, megatron-core 0.16 fails at its TE version check
        print("without patches:", type(error).__name__)
    from mindspeed_te.patches import build_registry
    build_registry().apply()
    config = OptimizerConfig(**kwargs)
    print("with patches:", config.store_param_remainders, "transformer_engine" in sys.modules)
""")


def test_megatron_precision_aware_config_passes_where_te_would():
    pytest.importorskip("megatron.core")
    run = subprocess.run([sys.executable, "-c", _CONFIG_CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "without patches: " in run.stdout
    assert "with patches: True False" in run.stdout  # store_param_remainders kept (TE >= 2.1); no TE left behind


VOCAB, SEQ, STEPS, SAVE_AT = 64, 16, 4, 2


def _megatron_worker(rank: int, world: int, directory: str, options: dict) -> dict:
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.library_compat import register_library_compat
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.optimizer import register_optimizer
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    for register in (register_megatron_te, register_device_cpu, register_library_compat, register_optimizer):
        register(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(1, 1)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}

    def build(seed):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
        gpt = Float16Module(config, GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=VOCAB,
                                             max_sequence_length=SEQ))
        bf16_grads = options.get("main_grads_dtype") == torch.bfloat16
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=not bf16_grads),
            gpt)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.01, use_distributed_optimizer=True, bf16=True,
            use_precision_aware_optimizer=True, **options), [model])
        return model, optimizer

    def train_step(model, optimizer, step):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, torch.arange(SEQ).expand(2, SEQ), None, labels=tokens.roll(-1, dims=1)).float().mean()
        loss.backward()
        model.finish_grad_sync()
        assert optimizer.step()[0]

    def sharded(model, optimizer, is_loading=False):
        model_sd = model.module.sharded_state_dict()
        return {"model": model_sd,
                "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}

    model, optimizer = build(1)
    for step in range(STEPS):
        if step == SAVE_AT:
            dist_checkpointing.save(sharded(model, optimizer), directory)
        train_step(model, optimizer, step)
    straight = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, optimizer = build(2)  # other weights: everything must come from the checkpoint
    loaded = dist_checkpointing.load(sharded(model, optimizer, is_loading=True), directory)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    for step in range(SAVE_AT, STEPS):
        train_step(model, optimizer, step)
    inner = optimizer.chained_optimizers[0].optimizer if hasattr(optimizer, "chained_optimizers") \
        else optimizer.optimizer
    state = next(iter(inner.state.values()))
    return {"optimizer": type(inner).__name__, "formats": {k: f.name for k, f in inner.formats.items()},
            "dtypes": {k: v.dtype for k, v in state.items()},
            "steps": {group["step"] for group in inner.param_groups if group["params"]},
            "straight": straight, "resumed": {name: p.detach().clone() for name, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize("options, moments", [
    (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, main_grads_dtype=torch.bfloat16),
     torch.float8_e4m3fn),
    (dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16), torch.bfloat16),
], ids=["fp8-moments-bf16-grads", "bf16-moments"])
def test_megatron_distributed_optimizer_resumes_exactly(tmp_path, options, moments):
    pytest.importorskip("megatron.core")
    from tests.dist_utils import run_distributed

    for result in run_distributed(_megatron_worker, 2, str(tmp_path), options):
        assert result["optimizer"] == "FusedAdam"
        assert result["dtypes"] == {"exp_avg": moments, "exp_avg_sq": moments, "master_param": torch.int16}
        assert result["steps"] == {STEPS}
        for name, value in result["straight"].items():
            assert torch.equal(result["resumed"][name], value), name
    assert not math.isnan(float(next(iter(result["straight"].values())).float().sum()))


# The memory bench's rows ---------------------------------------------------------------------------------
def test_memory_bench_counts_18_bytes_for_bf16_and_at_most_9_for_fp8_weights_and_moments():
    from mindspeed_te.bench.memory import COMBINATIONS, bytes_per_parameter
    from mindspeed_te.bench.report import TARGETS

    rows = {combo.label: bytes_per_parameter(combo, hidden=64, layers=1) for combo in COMBINATIONS}
    assert rows["bf16 weights + fp32 grads, master, moments"] == {"weights": 2.0, "grads": 4.0, "optimizer": 12.0,
                                                                 "total": 18.0}
    fp8_moments = rows["bf16 weights + bf16 grads, master remainders, fp8 moments"]
    assert fp8_moments["total"] == pytest.approx(8.0, abs=0.01)  # + the scales
    targeted = [label for label in rows if f"bytes per parameter, {label}" in TARGETS]
    assert len(targeted) == 2
    for label in targeted:
        assert rows[label]["weights"] == pytest.approx(1.0, abs=0.02)
        assert rows[label]["total"] <= TARGETS[f"bytes per parameter, {label}"][0]
