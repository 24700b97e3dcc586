from langchain_contextpilot import __all__

EXPECTED_ALL = [
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
]


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)


def test_the_postprocessor_name_is_the_compressor() -> None:
    from langchain_core.documents import BaseDocumentCompressor

    from langchain_contextpilot import ContextPilotCompressor, ContextPilotPostprocessor

    assert ContextPilotPostprocessor is ContextPilotCompressor
    assert issubclass(ContextPilotCompressor, BaseDocumentCompressor)
