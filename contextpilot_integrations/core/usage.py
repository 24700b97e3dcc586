"""Token counts that come from outside (an engine's usage report, a trace, a caller):
checked before they count.

A count is an ``int`` (not a ``bool``, not a ``float``), at least 0 and at most
:data:`MAX_TOKENS`; cached prompt tokens are part of the prompt tokens, so never more.
Anything else is no real prompt but a broken engine or file, and would only break the
statistics (a hit ratio above 100%, a table a thousand digits wide).
"""

from __future__ import annotations

__all__ = ["MAX_TOKENS", "check_token_count", "check_usage"]

MAX_TOKENS = 2**31 - 1
"""The most tokens one prompt (or one block of it) may count: 2,147,483,647, what a
signed 32-bit count holds and far above any model's context window."""


def check_token_count(name: str, value: object) -> int:
    """``value`` as a token count, or ``TypeError`` (not an int) / ``ValueError`` (out of range)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    if not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be in 0..{MAX_TOKENS:,}, got {_shown(value)}")
    return value


def _shown(value: int) -> str:
    """A count for a message, even one too long to print (Python refuses 4,300+ digits)."""
    if abs(value) < 10**15:
        return f"{value:,}"
    return f"{'-' if value < 0 else ''}about 2**{abs(value).bit_length() - 1}"


def check_usage(prompt_tokens: object, cached_tokens: object) -> None:
    """An engine's report for one prompt: each count ``None`` or a token count, and the
    cached tokens at most the prompt tokens (and given only with them), so every hit ratio
    stays within [0, 1].

    Raises:
        TypeError, ValueError: naming the bad count.
    """
    if prompt_tokens is not None:
        check_token_count("prompt_tokens", prompt_tokens)
    if cached_tokens is not None:
        check_token_count("cached_tokens", cached_tokens)
    if cached_tokens is not None and prompt_tokens is None:  # a share of nothing: no ratio holds it
        raise ValueError(f"cached_tokens ({cached_tokens:,}) without prompt_tokens")
    if prompt_tokens is not None and cached_tokens is not None and cached_tokens > prompt_tokens:  # type: ignore[operator]
        raise ValueError(f"cached_tokens ({cached_tokens:,}) exceed prompt_tokens ({prompt_tokens:,})")
