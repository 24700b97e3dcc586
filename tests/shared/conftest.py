"""Every test here signs the shared log with a secret of its own (as a deployment does)."""

from __future__ import annotations

import secrets

import pytest

SECRET_ENV = "CONTEXTPILOT_SHARED_SECRET"  # the name SharedOptions reads


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    secret = secrets.token_hex(16)
    monkeypatch.setenv(SECRET_ENV, secret)  # worker processes inherit it
    return secret
