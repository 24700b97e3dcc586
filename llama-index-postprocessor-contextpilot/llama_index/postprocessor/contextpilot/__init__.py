"""llama-index-postprocessor-contextpilot: make LlamaIndex RAG reuse the engine's prefix KV cache.

- :class:`ContextPilotPostprocessor` goes where ``LongContextReorder`` goes
  (``index.as_query_engine(node_postprocessors=[...])``): nodes in send order, shared ones
  first, scores and metadata kept;
- :class:`ContextPilotChatEngine` keeps each turn's context in the chat history and sends
  documents already shown as location references, until the memory drops the turn that
  showed them;
- :class:`ContextPilotLLM` wraps any LLM (``OpenAI``, ``OpenAILike``, ``Anthropic``, ...): it
  sends the request prepared for its query (found through the instrumentation span tree,
  never by searching the prompt) and reports the provider's cached tokens; :class:`SGLangLLM`
  is ``OpenAILike`` preset for SGLang and other OpenAI-compatible engines;
- :class:`ContextPilotEvent` is emitted through the instrumentation dispatcher.

The chat engine ships in this package, not a second one: LlamaHub has no integration type
for chat engines, and it is the postprocessor's de-duplication carried across turns (same
pilot, same labels). The method is ContextPilot (MLSys 2026); the framework-free core is
``contextpilot-integrations``.
"""

from llama_index.postprocessor.contextpilot.base import ContextPilotEvent, ContextPilotPostprocessor
from llama_index.postprocessor.contextpilot.chat_engine import ContextPilotBindingWarning, ContextPilotChatEngine
from llama_index.postprocessor.contextpilot.llms import ContextPilotLLM, SGLangLLM

__all__ = [
    "ContextPilotBindingWarning",
    "ContextPilotChatEngine",
    "ContextPilotEvent",
    "ContextPilotLLM",
    "ContextPilotPostprocessor",
    "SGLangLLM",
]
