"""`python -m tests.fp8_param_probe pretrain_gpt.py ...`: `mindspeed_te.launch` plus a report of what the
--fp8-param-gather tests check, printed by rank 0 at exit as one line `FP8PROBE {json}`:

- the model's parameters after Megatron's setup: how many are QuantizedTensors, their code sizes, Megatron's
  parameter buffer dtypes, and whether every quantized weight's codes live in the uint8 buffer;
- every parameter all-gather of Megatron's distributed optimizer, counted where it is called
  (`param_and_grad_buffer.dist_all_gather_func`): elements and bytes per buffer dtype.
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


def _model_report(model: list) -> dict:
    from mindspeed_te.quantized_tensor import QuantizedTensor

    params = [p for chunk in model for p in chunk.parameters()]
    quantized = [p for p in params if isinstance(p, QuantizedTensor)]
    buffers = [b for chunk in model for b in [*chunk.buffers, *chunk.expert_parallel_buffers]]
    uint8 = [b.param_data for b in buffers if b.param_dtype == torch.uint8]
    return {
        "quantized_params": len(quantized),
        "quantized_elements": sum(p.numel() for p in quantized),
        "code_bytes_per_element": sorted({p._data.element_size() for p in quantized}),
        "buffer_dtypes": sorted({str(b.param_dtype) for b in buffers}),
        "codes_in_uint8_buffer": all(any(_inside(p._data, buf) for buf in uint8) for p in quantized),
    }


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

    def recorded_setup(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        report.update(_model_report(model))
        return model, optimizer, scheduler

    param_and_grad_buffer.dist_all_gather_func = counted_gather
    training.setup_model_and_optimizer = recorded_setup

    def emit() -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            print("FP8PROBE " + json.dumps(report), flush=True)

    atexit.register(emit)
    from mindspeed_te.launch import main as launch

    launch([script, *rest])


if __name__ == "__main__":
    main()
