"""Shared fixtures: the bundled MultiHop-RAG sample (real data, shipped in the package)."""

from __future__ import annotations

import pytest

from contextpilot_integrations.testing.audit import audited_bodies  # noqa: F401  (autouse: audits every body sent)
from contextpilot_integrations.whatif.datasets import MultiHopRAG, load_multihop_rag


@pytest.fixture(scope="session")
def multihop() -> MultiHopRAG:
    return load_multihop_rag()
