"""Metric sinks and the live console. Metrics are plain `dict[str, float]`, one dict per step."""

from lmrl.logging.console import Console
from lmrl.logging.sinks import JsonlSink, MetricSink, TensorBoardSink, WandbSink, make_sinks

__all__ = ["Console", "JsonlSink", "MetricSink", "TensorBoardSink", "WandbSink", "make_sinks"]
