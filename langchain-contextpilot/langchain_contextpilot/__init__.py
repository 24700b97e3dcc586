"""langchain-contextpilot: LangChain components that make RAG reuse the engine's prefix KV cache.

- :class:`ContextPilotRetriever` wraps any retriever: the same documents, shared ones first;
- :class:`ContextPilotCompressor` (alias ``ContextPilotPostprocessor``) does the same as a
  document compressor, and :func:`contextpilot_reorder` as an LCEL step;
- :func:`format_documents` renders them (blocks, location references, order annotation);
- :class:`ContextPilotChatModel` wraps any chat model (``ChatOpenAI``, ``ChatAnthropic``, ...):
  it sends the request prepared earlier in the same invocation (found through LangChain's
  run tree, never by searching the prompt) and reports the provider's cached tokens;
  :class:`ChatSGLang` is ``ChatOpenAI`` preset for SGLang and other OpenAI-compatible engines;
- :class:`ConversationalRAG` is multi-turn RAG with memory (a Runnable), where documents
  already shown become location references to the history it sends;
- :class:`ContextPilotMiddleware` (``langchain_contextpilot.middleware``, needs ``langchain``)
  does the same for a ``create_agent`` agent whose tools return documents, and places the
  hosted API's cache markers (:mod:`.cache_markers`).

Components that never see the prompt (retriever, compressor, LCEL step) send every document
in full; where messages leave for the engine, a reference whose text is missing is put back.

The method is ContextPilot (MLSys 2026); the framework-free core is
``contextpilot-integrations``.
"""

from importlib import metadata

from ._binding import ContextPilotBindingWarning
from ._documents import conversation_id_from_config, partition_from_config
from .chat_models import ChatSGLang, ContextPilotChatModel
from .compressors import ContextPilotCompressor, ContextPilotPostprocessor, contextpilot_reorder
from .conversational import ConversationalRAG
from .formatting import format_documents, format_documents_runnable
from .retrievers import ContextPilotRetriever


def __getattr__(name: str) -> object:
    if name == "ContextPilotMiddleware":  # imports langchain (agents), an optional dependency
        from .middleware import ContextPilotMiddleware

        return ContextPilotMiddleware
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    __version__ = metadata.version(__package__ or __name__)
except metadata.PackageNotFoundError:  # running from a source tree
    __version__ = ""

__all__ = [
    "ChatSGLang",
    "ContextPilotBindingWarning",
    "ContextPilotChatModel",
    "ContextPilotCompressor",
    "ContextPilotPostprocessor",
    "ContextPilotRetriever",
    "ConversationalRAG",
    "__version__",
    "contextpilot_reorder",
    "conversation_id_from_config",
    "format_documents",
    "format_documents_runnable",
    "partition_from_config",
]
