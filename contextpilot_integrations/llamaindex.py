"""Deprecated: the LlamaIndex components moved to ``llama-index-postprocessor-contextpilot``.

``from llama_index.postprocessor.contextpilot import ...``; this path re-exports them for
one release.
"""

import warnings

from llama_index.postprocessor.contextpilot import *  # noqa: F403
from llama_index.postprocessor.contextpilot import __all__  # noqa: F401

warnings.warn(
    "contextpilot_integrations.llamaindex is deprecated: pip install llama-index-postprocessor-contextpilot "
    "and import from llama_index.postprocessor.contextpilot",
    DeprecationWarning,
    stacklevel=2,
)
