"""What-if tooling: how much would ContextPilot save on a trace, in a simulator or on a
real server. The ``contextpilot-integrations`` console script is :mod:`.cli`."""

from .engine_compare import EngineComparison, EngineComparisonError, flush_engine_cache
from .replay import PromptShape, ReplayResult, arrival_order, replay, reuse_bound_of_prompts, serve_orders
from .simulate import RadixCacheSimulator, SimulatedRequest
from .trace import (
    TraceError,
    TraceRequest,
    block_token_counts,
    estimate_tokens,
    load_trace,
    multihop_chats,
    multihop_trace,
    reuse_bound,
    working_set_tokens,
)

__all__ = [
    "EngineComparison",
    "EngineComparisonError",
    "PromptShape",
    "RadixCacheSimulator",
    "ReplayResult",
    "SimulatedRequest",
    "TraceError",
    "TraceRequest",
    "arrival_order",
    "block_token_counts",
    "estimate_tokens",
    "flush_engine_cache",
    "load_trace",
    "multihop_chats",
    "multihop_trace",
    "replay",
    "reuse_bound",
    "reuse_bound_of_prompts",
    "serve_orders",
    "working_set_tokens",
]
