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
    "partition_from_config",
]


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)


def test_the_postprocessor_name_is_the_compressor() -> None:
    from langchain_core.documents import BaseDocumentCompressor

    from langchain_contextpilot import ContextPilotCompressor, ContextPilotPostprocessor

    assert ContextPilotPostprocessor is ContextPilotCompressor
    assert issubclass(ContextPilotCompressor, BaseDocumentCompressor)


def test_the_middleware_without_the_agents_extra_names_it() -> None:
    """The base install has neither langchain nor langgraph: importing the middleware says
    which extra brings them."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['langchain.agents.middleware.types'] = None\n"
        "try:\n    import langchain_contextpilot.middleware\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'langchain-contextpilot[agents]'" in out
    import langchain_contextpilot  # the package itself never needs them

    assert langchain_contextpilot.ContextPilotRetriever is not None
