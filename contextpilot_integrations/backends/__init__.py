"""Deprecated: moved to :mod:`contextpilot_integrations.engines` (re-exported for one release)."""

import warnings

from ..engines import *  # noqa: F403
from ..engines import __all__  # noqa: F401

warnings.warn(
    "contextpilot_integrations.backends is deprecated: import from contextpilot_integrations.engines",
    DeprecationWarning,
    stacklevel=2,
)
