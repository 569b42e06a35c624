"""The one error type of :mod:`models.hf`."""

from __future__ import annotations


class HFError(ValueError):
    """A Hugging Face checkpoint that cannot be read as the model it claims to be."""
