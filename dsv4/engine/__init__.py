"""A small continuous-batching engine over the cache manager (``dsv4 demo``)."""

from dsv4.engine.runner import (
    EngineRunner,
    Request,
    RequestResult,
    RunResult,
    StepInfo,
    Tolerance,
    make_workload,
    memory_by_layer_kind,
)

__all__ = [
    "EngineRunner",
    "Request",
    "RequestResult",
    "RunResult",
    "StepInfo",
    "Tolerance",
    "make_workload",
    "memory_by_layer_kind",
]
