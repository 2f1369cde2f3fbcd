"""The bench's Megatron GPT step measures what a training step does: each step quantizes the updated weights, as
Megatron's schedule asks of TE modules at a step's first micro-batch (`set_is_first_microbatch`)."""
import warnings

from tests.dist_utils import run_distributed


def _quantizes_per_step(rank: int, world: int) -> list[int]:
    """Tensors the batched quantizes took in each of three steps of a 1-layer GPT (tensorwise E4M3, reference
    backend)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from mindspeed_te.bench.gpt import gpt_step
    from mindspeed_te.kernels.reference import ReferenceBackend
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(1, 1)
    counted = [0]
    quantize_many = ReferenceBackend.quantize_many

    def counting(self, quantizers, tensors):
        counted[0] += len(tensors)
        return quantize_many(self, quantizers, tensors)

    ReferenceBackend.quantize_many = counting
    step = gpt_step(("e4m3", "tensorwise"), layers=1, hidden=128, seq=32, batch=1, vocab=64)
    per_step = []
    for _ in range(3):
        counted[0] = 0
        step()
        per_step.append(counted[0])
    return per_step


def test_gpt_step_quantizes_the_weights_every_step():
    """Every step quantizes as many tensors in the forward's batched quantizes as the first: the four linear
    layers' weights and inputs (without the flag, later steps reuse the first step's quantized weights: 4)."""
    per_step = run_distributed(_quantizes_per_step, 1)[0]
    assert per_step[0] == per_step[1] == per_step[2] == 8, per_step
