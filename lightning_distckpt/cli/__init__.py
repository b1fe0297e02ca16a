"""Command line: ``lightning-distckpt inspect|validate DIR`` (also ``python -m lightning_distckpt``)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
