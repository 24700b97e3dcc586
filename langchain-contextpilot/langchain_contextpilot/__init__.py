"""langchain-contextpilot: LangChain components that make RAG reuse the engine's prefix KV cache.

- :class:`ContextPilotRetriever` wraps any retriever: the same documents, shared ones first;
- :class:`ContextPilotCompressor` (alias ``ContextPilotPostprocessor``) does the same as a
  document compressor, and :func:`contextpilot_reorder` as an LCEL step;
- :func:`format_documents` renders them (blocks, location references, order annotation);
- :class:`ChatSGLang` is ``ChatOpenAI`` that sends ContextPilot's request id and reports the
  server's cached tokens;
- :class:`ConversationalRAG` is multi-turn RAG with memory, where documents already shown
  become location references.

The method is ContextPilot (MLSys 2026); the framework-free core is
``contextpilot-integrations``.
"""

from importlib import metadata

from ._documents import conversation_id_from_config
from .chat_models import ChatSGLang
from .compressors import ContextPilotCompressor, ContextPilotPostprocessor, contextpilot_reorder
from .conversational import ConversationalRAG
from .formatting import format_documents, format_documents_runnable
from .retrievers import ContextPilotRetriever

try:
    __version__ = metadata.version(__package__ or __name__)
except metadata.PackageNotFoundError:  # running from a source tree
    __version__ = ""

__all__ = [
    "ChatSGLang",
    "ContextPilotCompressor",
    "ContextPilotPostprocessor",
    "ContextPilotRetriever",
    "ConversationalRAG",
    "__version__",
    "contextpilot_reorder",
    "conversation_id_from_config",
    "format_documents",
    "format_documents_runnable",
]
