"""The ``kvstore`` console script: one module per group of commands, routed by main.py."""

from kvstore.cli.main import main

__all__ = ["main"]
