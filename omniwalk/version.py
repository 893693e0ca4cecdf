"""The installed package's version, as `pip` and `omniwalk --version` report it."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The version of the installed `omniwalk` distribution (pyproject's `version`); "unknown"
    when the code runs from a folder that was never installed."""
    try:
        return importlib.metadata.version("omniwalk")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
