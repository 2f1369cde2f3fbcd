"""`python -m tests.fp8_param_probe pretrain_gpt.py ...`: `mindspeed_te.launch` plus a report of what the
--fp8-param-gather tests check, printed by rank 0 at exit as one line `FP8PROBE {json}`:

- the model's parameters after Megatron's setup: how many are QuantizedTensors, the bytes per element of their
  codes in Megatron's buffer, its parameter buffer dtypes, and whether every quantized weight's codes live in the
  uint8 buffer;
- every parameter all-gather of Megatron's distributed optimizer, counted where it is called
  (`param_and_grad_buffer.dist_all_gather_func`): elements and bytes per buffer dtype;
- the quantizers that ran (`quantized_by`: calls of each quantizer class's `quantize`, on this rank);
- at exit, the copies of the weights that exist besides their codes (`copies`): quantized weights still holding a
  high-precision initial value, modules keeping a quantized weight cache, high-precision tensors shaped like a
  quantized weight among the modules' attributes, the data forms each weight class holds, and the elements of
  the distributed optimizer's fp32 main shards on this rank.
"""
from __future__ import annotations

import atexit
import json
import os
import sys

import torch


def _inside(data: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    return start <= data.data_ptr() and data.data_ptr() + data.numel() * data.element_size() <= end


def _held_codes(param: torch.Tensor, uint8: list[torch.Tensor]) -> torch.Tensor:
    """The form of the weight's codes that lives in a uint8 parameter buffer (FP4 weights: packed two per byte
    from megatron-core 0.17), else its codes one per byte."""
    forms = [param._data, *([param._rowwise_data] if hasattr(param, "_rowwise_data") else [])]
    return next((f for f in forms if any(_inside(f, buf) for buf in uint8)), param._data)


def _model_report(model: list) -> dict:
    from mindspeed_te.quantized_tensor import QuantizedTensor

    params = [p for chunk in model for p in chunk.parameters()]
    quantized = [p for p in params if isinstance(p, QuantizedTensor)]
    buffers = [b for chunk in model for b in [*chunk.buffers, *chunk.expert_parallel_buffers]]
    uint8 = [b.param_data for b in buffers if b.param_dtype == torch.uint8 and b.param_data is not None]
    return {
        "quantized_params": len(quantized),
        "quantized_elements": sum(p.numel() for p in quantized),
        "code_bytes_per_element": sorted({_held_codes(p, uint8).numel() * _held_codes(p, uint8).element_size()
                                          / p.numel() for p in quantized}),
        "param_types": sorted({type(p).__name__ for p in quantized}),
        "buffer_dtypes": sorted({str(b.param_dtype) for b in buffers}),
        "codes_in_uint8_buffer": all(any(_inside(_held_codes(p, uint8), buf) for buf in uint8) for p in quantized),
    }


def _copies_report(model: list, optimizer) -> dict:
    from mindspeed_te.quantized_tensor import QuantizedTensor

    quantized = [p for chunk in model for p in chunk.parameters() if isinstance(p, QuantizedTensor)]
    shapes = {tuple(p.shape) for p in quantized} | {tuple(p.shape)[::-1] for p in quantized}
    modules = [m for chunk in model for m in chunk.modules()]
    attributes = [v for m in modules for v in vars(m).values()
                  if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    forms = {f"{type(p).__name__}: " + "+".join(sorted(k for k, v in vars(p._storage).items()
                                                       if k.endswith("data") and isinstance(v, torch.Tensor)))
             for p in quantized}
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return {
        "init_values": sum(getattr(p, "_high_precision_init_val", None) is not None for p in quantized),
        "cached_weights": sum(getattr(getattr(m, "_weight_cache", None), "quantized", None) is not None
                              for m in modules),
        "weight_shaped_attributes": sum(t.is_floating_point() and tuple(t.shape) in shapes for t in attributes),
        "forms": sorted(forms),
        "main_elements": sum(shard.numel() for o in inner for group in getattr(o, "shard_fp32_from_float16_groups", [])
                             for shard in group),
    }


def _count_quantizers(counts: dict) -> None:
    """Count each quantizer class's `quantize` calls into `counts` (class name -> calls)."""
    from mindspeed_te import quantizers

    def counting(name: str, quantize):
        def counted(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return quantize(self, *args, **kwargs)

        return counted

    for cls in vars(quantizers).values():
        if isinstance(cls, type) and issubclass(cls, quantizers.Quantizer) and "quantize" in vars(cls):
            cls.quantize = counting(cls.__name__, vars(cls)["quantize"])


def main() -> None:
    script, *rest = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # Megatron-LM's megatron package, as launch does
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.training import training

    import mindspeed_te.megatron_adaptor  # noqa: F401  (applies the patches)

    report: dict = {"gather": {}}
    gather = param_and_grad_buffer.dist_all_gather_func

    def counted_gather(output, inp, *args, **kwargs):
        elements, size = report["gather"].get(str(output.dtype), (0, 0))
        report["gather"][str(output.dtype)] = (elements + output.numel(), size + output.numel() * output.element_size())
        return gather(output, inp, *args, **kwargs)

    setup = training.setup_model_and_optimizer

    built: list = []

    def recorded_setup(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        report.update(_model_report(model))
        built[:] = [model, optimizer]
        return model, optimizer, scheduler

    param_and_grad_buffer.dist_all_gather_func = counted_gather
    _count_quantizers(report.setdefault("quantized_by", {}))
    training.setup_model_and_optimizer = recorded_setup

    def emit() -> None:
        if built:
            report["copies"] = _copies_report(*built)
        if int(os.environ.get("RANK", "0")) == 0:
            print("FP8PROBE " + json.dumps(report), flush=True)

    atexit.register(emit)
    from mindspeed_te.launch import main as launch

    launch([script, *rest])


if __name__ == "__main__":
    main()
