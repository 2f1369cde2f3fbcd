"""Fp8Padding/Fp8Unpadding, te_checkpoint with FP8 modules, the RNG states tracker."""
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.megatron.misc import (
    Fp8Padding,
    Fp8Unpadding,
    TECudaRNGStatesTracker,
    get_cpu_offload_context,
    te_checkpoint,
)
from mindspeed_te.modules import Linear


def test_padding_round_trip_and_gradients():
    x = torch.randn(5 + 0 + 17, 8, requires_grad=True)
    splits = [5, 0, 17]
    padded, psplits = Fp8Padding(3)(x, splits)
    assert psplits == [16, 0, 32] and padded.shape == (48, 8)
    assert torch.equal(padded[:5], x[:5]) and not padded[5:16].any() and torch.equal(padded[16:33], x[5:])
    back = Fp8Unpadding(3)(padded, splits)
    assert torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        assert Fp8Padding(1)(torch.ones(40, 2), [40])[1] == [64]
    with pytest.raises(ValueError, match="m_splits"):
        Fp8Padding(2)(x, [1, 2])


def test_padding_copies_the_rows_once_each_way():
    """Fp8Padding and Fp8Unpadding are one concatenation each way, with views of zeros kept per shape (per-expert
    pads and slices took a launch each: 24 per MoE micro-batch); each one's gradient is the other's relay of the
    seed: padding keeps the real rows' gradients, unpadding gives the padding rows zero."""
    from mindspeed_te.diagnostics import LaunchCounter

    splits, gen = [5, 0, 17, 32], torch.Generator().manual_seed(0)
    x = torch.randn(sum(splits), 8, generator=gen, requires_grad=True)
    with LaunchCounter() as forward:
        padded, padded_splits = Fp8Padding(4)(x, splits)
    seed = torch.randn(padded.shape, generator=gen)
    with LaunchCounter() as backward:
        padded.backward(seed)
    assert padded_splits == [16, 0, 32, 32] and forward.counts == backward.counts == {"aten.cat": 1}
    assert torch.equal(x.grad, torch.cat([seed[0:5], seed[16:33], seed[48:80]]))
    with LaunchCounter() as other_routing:  # other pads, the same kept zeros: no fill
        Fp8Padding(4)(x.detach()[:40], [2, 14, 16, 8])
    assert other_routing.counts == {"aten.cat": 1}
    rows = padded.detach().requires_grad_()
    with LaunchCounter() as forward:
        back = Fp8Unpadding(4)(rows, splits)
    seed = torch.randn(back.shape, generator=gen)
    with LaunchCounter() as backward:
        back.backward(seed)
    assert torch.equal(back, x.detach()) and forward.counts == backward.counts == {"aten.cat": 1}
    want = torch.zeros(80, 8)
    want[0:5], want[16:33], want[48:80] = seed[0:5], seed[5:22], seed[22:54]
    assert torch.equal(rows.grad, want)


def _block(layers):
    def run(x):
        return layers[1](torch.nn.functional.gelu(layers[0](x)))
    return run


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_format=Format.HIF8, amax_history_len=4),
                                    Float8CurrentScaling(fp8_format=Format.HYBRID)])
def test_checkpointed_fp8_region_matches_plain_run(recipe):
    def run(checkpointed: bool):
        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        layers = [Linear(32, 64), Linear(64, 32)]
        grads = []
        for step in range(3):  # the scale changes between steps; the recompute must use the first pass's
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step), requires_grad=True) * (step + 1)
            with fp8_autocast(fp8_recipe=recipe):
                y = te_checkpoint(_block(layers), False, None, None, x) if checkpointed else _block(layers)(x)
            y.square().sum().backward()
            grads.append((y.detach(), layers[0].weight.grad.clone(), layers[1].weight.grad.clone()))
            for layer in layers:
                layer.weight.grad = None
        states = [tuple(t.clone() for t in (m.fp8_states[0].scale, m.fp8_states[1].scale)) for m in layers
                  if hasattr(m.fp8_states[0], "scale")]
        return grads, states

    plain, plain_states = run(False)
    ckpt, ckpt_states = run(True)
    for a, b in zip(plain, ckpt):
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb)
    for a, b in zip(plain_states, ckpt_states):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert FP8GlobalStateManager.quantization_state.checkpoint_stash == []


def test_rng_tracker_streams_are_reproducible_and_isolated():
    tracker = TECudaRNGStatesTracker()
    assert not tracker.is_initialized()
    tracker.add("model-parallel-rng", 123)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    states = tracker.get_states()
    with tracker.fork():
        b = torch.rand(4)
    tracker.set_states(states)
    with tracker.fork():
        c = torch.rand(4)
    assert not torch.equal(a, b) and torch.equal(b, c)
    with pytest.raises(ValueError, match="seed"):
        tracker.add("other", 123)


def test_cpu_offload_context():
    """Megatron's positional call (enabled, num_layers, model_layers, activations, weights, double_buffering
    [, retain_pinned_cpu_buffers]); tests/test_cpu_offload.py checks what the context does."""
    ctx, sync = get_cpu_offload_context(False, 2, 2, False, False, False)
    with ctx:
        assert sync(3) == 3
    ctx, sync = get_cpu_offload_context(True, 1, 4, True, False, False, True)
    assert (ctx.num_layers, ctx.model_layers, ctx.retain_pinned_cpu_buffers, ctx.inside_context) == (1, 4, True, False)
    with ctx:
        assert ctx.inside_context  # what Megatron's own linear layers read
    with pytest.raises(ValueError, match="--cpu-offloading-num-layers"):
        get_cpu_offload_context(True, 2, 2, True, False, False)


def _cross_entropy_worker(rank: int, world: int) -> dict:
    """te_parallel_cross_entropy over a 2-rank vocabulary split against the unsplit log-softmax."""
    from mindspeed_te.megatron.misc import te_parallel_cross_entropy

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2, 16, generator=g, dtype=torch.float64).float()
    labels = torch.randint(0, 16, (5, 2), generator=g)
    labels[1, 0] = -100  # TE's ignore_idx
    group = torch.distributed.new_group(list(range(world)))
    mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = te_parallel_cross_entropy(mine, labels, group)
    assert torch.equal(mine, logits.chunk(world, -1)[rank])  # the logits are left as they were
    loss.sum().backward()
    full = logits.clone().requires_grad_()
    want = -torch.log_softmax(full, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    want = want.masked_fill(labels == -100, 0.0)
    want.sum().backward()
    return dict(loss=loss.detach(), want=want.detach(), grad=mine.grad, want_grad=full.grad.chunk(world, -1)[rank])


def test_te_parallel_cross_entropy_matches_the_full_softmax_and_ignores_label_minus_100():
    """--cross-entropy-fusion-impl te calls TE's parallel_cross_entropy: per-token loss of vocabulary-parallel
    logits, label -100 giving loss and gradient zero. Over 2 gloo ranks it equals the unsplit log-softmax."""
    from tests.dist_utils import run_distributed

    for res in run_distributed(_cross_entropy_worker, 2):
        assert res["loss"].dtype == torch.float32 and res["loss"][1, 0] == 0 and not res["grad"][1, 0].any()
        torch.testing.assert_close(res["loss"], res["want"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["grad"], res["want_grad"], rtol=1e-5, atol=1e-6)
