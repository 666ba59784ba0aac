"""Credentials on the wire: how a bearer token rides on a gRPC call."""

from __future__ import annotations

__all__ = ["bearer_metadata"]


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying a bearer token."""
    return (("authorization", f"Bearer {token}"),)
