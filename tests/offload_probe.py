"""`python -m tests.offload_probe pretrain_gpt.py ...`: `mindspeed_te.launch` plus a count of what the activation
offload moved, printed by rank 0 at exit as one line `OFFLOADPROBE {json}`: the storages copied to host memory
(count, bytes, and bytes per element size: codes are 1 byte) and the views read back in backward."""
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
