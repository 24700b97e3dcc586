"""Everything that talks to an inference server: send prepared requests, read back cached
tokens, and keep the index true from the engine's KV-cache events.

- :class:`OpenAICompatClient`: chat completions with the request id, TTFT and cached tokens;
- :class:`EvictionListener`: the HTTP callback server our SGLang plugin posts events to;
- :class:`ZmqEventSubscriber`: follows a stock SGLang or vLLM KV-event socket (no plugin);
- :class:`KvEventSink`: applies event batches from any transport to a pilot;
- :class:`EngineTokenCounter`: counts tokens with the engine's own ``/tokenize``;
- :func:`read_engine_info` / :func:`learn_engine`: the engine's page, KV pool and tokenizer, for a pilot;
- :class:`EngineBlockMap`: engine block hashes <-> our request ids;
- :mod:`.wire`: the engines' formats; :mod:`.sglang_plugin`: the publisher loaded in SGLang.
"""

from ..errors import EngineError, EngineHTTPError, EngineTimeout, EngineUnavailable
from .client import ChatResult, OpenAICompatClient, redact_url
from .engine_info import EngineInfo, learn_engine, read_engine_info
from .kv_mapping import EngineBlockMap
from .listener import EvictionListener
from .router import CacheAwarePolicy, Routed, RoutedResult, Router, RoutingClient, Target, TargetStats
from .sink import KvEventSink, SinkStats
from .tokens import EngineTokenCounter
from .wire import ENGINES, REQUEST_ID_FIELDS, KvEventBatch
from .zmq_subscriber import SubscriberStats, ZmqEventSubscriber, subscribe_ranks

__all__ = [
    "ENGINES",
    "REQUEST_ID_FIELDS",
    "ChatResult",
    "EngineBlockMap",
    "EngineInfo",
    "EngineError",
    "EngineHTTPError",
    "EngineTimeout",
    "EngineTokenCounter",
    "EngineUnavailable",
    "CacheAwarePolicy",
    "EvictionListener",
    "KvEventBatch",
    "KvEventSink",
    "OpenAICompatClient",
    "Routed",
    "RoutedResult",
    "Router",
    "RoutingClient",
    "SinkStats",
    "SubscriberStats",
    "Target",
    "TargetStats",
    "ZmqEventSubscriber",
    "learn_engine",
    "read_engine_info",
    "redact_url",
    "subscribe_ranks",
]
