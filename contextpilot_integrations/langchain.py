"""Deprecated: the LangChain components moved to ``langchain-contextpilot``.

``from langchain_contextpilot import ...``; this path re-exports them for one release.
"""

import warnings

from langchain_contextpilot import *  # noqa: F403
from langchain_contextpilot import __all__  # noqa: F401

warnings.warn(
    "contextpilot_integrations.langchain is deprecated: pip install langchain-contextpilot and "
    "import from langchain_contextpilot",
    DeprecationWarning,
    stacklevel=2,
)
