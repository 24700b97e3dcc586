"""Engine backends: send prepared requests to an inference server and read back its cache use."""

from .openai_compat import (
    ChatResult,
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
    OpenAICompatClient,
)

__all__ = ["ChatResult", "EngineError", "EngineHTTPError", "EngineUnavailable", "OpenAICompatClient"]
