"""Debugging tools: the per-layer FP8 numerics report and named event counters."""
from mindspeed_te.debug.counters import count, counters, reset_counters
from mindspeed_te.debug.numerics import COUNTERFACTUALS, TensorStats, tensor_stats
from mindspeed_te.debug.report import NumericsReport, plot_heatmaps

__all__ = ["NumericsReport", "plot_heatmaps", "TensorStats", "tensor_stats", "COUNTERFACTUALS",
           "count", "counters", "reset_counters"]
