"""contextpilot-integrations: reuse the engine's prefix KV cache across RAG requests.

Reorders retrieved blocks so shared blocks form a common prefix, schedules batches so
prefix-sharing requests run back to back, restates the retriever's ranking in an order
annotation, and replaces blocks already sent in a conversation with location references.
Method: ContextPilot (MLSys 2026, "Fast Long-Context Inference via Context Reuse").
"""

from .core.annotations import Templates, parse_order_annotation, render_block
from .core.blocks import Block, content_id
from .core.partitions import cache_partition, partition_of_body
from .core.prepared import PreparedRequest, Reference
from .errors import (
    BlockTypeError,
    ContextPilotError,
    DuplicateBlockError,
    DuplicateRequestError,
    InvalidBlockError,
    UnknownStrategyError,
)
from .index.strategies import STRATEGIES
from .integration.batching import MicroBatcher
from .pilot import BatchRequest, ContextPilot, PilotStats

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "BatchRequest",
    "Block",
    "BlockTypeError",
    "ContextPilot",
    "ContextPilotError",
    "DuplicateBlockError",
    "DuplicateRequestError",
    "InvalidBlockError",
    "MicroBatcher",
    "PilotStats",
    "PreparedRequest",
    "Reference",
    "Templates",
    "UnknownStrategyError",
    "__version__",
    "cache_partition",
    "content_id",
    "parse_order_annotation",
    "partition_of_body",
    "render_block",
]
