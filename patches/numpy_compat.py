"""NumPy 2 removed `numpy.product`, which megatron-core's distributed checkpointing still calls up to 0.15
(dist_checkpointing validation, mapping and exchange_utils, on a checkpoint save): where NumPy lacks it, it is
`numpy.prod` again while the patches are applied."""
from __future__ import annotations

import numpy


def register_numpy_compat(registry) -> None:
    """`numpy.product` as `numpy.prod` where this NumPy has none (2.0 on)."""
    if not hasattr(numpy, "product"):
        registry.register("numpy.product", numpy.prod, create=True)
