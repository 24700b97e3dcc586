"""Engine backends: send prepared requests to an inference server and read back its cache use."""

from .client import (
    ChatResult,
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
    OpenAICompatClient,
)

__all__ = ["ChatResult", "EngineError", "EngineHTTPError", "EngineUnavailable", "OpenAICompatClient"]
