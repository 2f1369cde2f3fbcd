"""`python -m tests.offload_probe pretrain_gpt.py ...`: `mindspeed_te.launch` plus what the offloads moved, printed
by rank 0 at exit as one line `OFFLOADPROBE {json}`: for activation offload, the storages copied to host memory
(count, bytes, and bytes per element size: codes are 1 byte) and the views read back in backward; for optimizer
offload (Megatron's HybridDeviceOptimizer), the parameter elements each part updates and its optimizer class."""
from __future__ import annotations

import atexit
import json
import os
import sys


def main() -> None:
    script, *rest = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # Megatron-LM's megatron package, as launch does
    from mindspeed_te.ops import cpu_offload

    report = {"offloaded": 0, "bytes": 0, "bytes_by_element_size": {}, "reloaded": 0, "schedules": 0}
    offload, reload, init = (cpu_offload.OffloadSchedule._offload, cpu_offload.OffloadSchedule.reload,
                             cpu_offload.OffloadSchedule.__init__)

    def counted_offload(self, t, storage):
        copy = offload(self, t, storage)
        size = copy.host.numel() * copy.host.element_size()
        report["offloaded"] += 1
        report["bytes"] += size
        by_size = report["bytes_by_element_size"]
        by_size[str(t.element_size())] = by_size.get(str(t.element_size()), 0) + size
        return copy

    def counted_reload(self, view):
        report["reloaded"] += 1
        return reload(self, view)

    def counted_init(self, *args, **kwargs):
        report["schedules"] += 1
        init(self, *args, **kwargs)

    from megatron.training import training

    setup = training.setup_model_and_optimizer

    def recorded_setup(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        hybrid = getattr(optimizer, "optimizer", None)
        if type(hybrid).__name__ == "HybridDeviceOptimizer":
            device = hybrid.gpu_optimizer
            report["optimizer"] = {
                "host_elements": sum(p.numel() for o in hybrid.cpu_optimizers for g in o.param_groups
                                     for p in g["params"]),
                "device_elements": sum(p.numel() for g in device.param_groups for p in g["params"]) if device else 0,
                "host_class": sorted({type(o).__qualname__ for o in hybrid.cpu_optimizers}),
                "device_class": type(device).__module__ + "." + type(device).__qualname__ if device else None}
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = recorded_setup
    cpu_offload.OffloadSchedule._offload = counted_offload
    cpu_offload.OffloadSchedule.reload = counted_reload
    cpu_offload.OffloadSchedule.__init__ = counted_init

    def emit() -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            print("OFFLOADPROBE " + json.dumps(report), flush=True)

    atexit.register(emit)
    from mindspeed_te.launch import main as launch

    launch([script, *rest])


if __name__ == "__main__":
    main()
