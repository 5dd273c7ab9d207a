"""Sparse dictionaries (TopK autoencoders and transcoders) over the model's sites, in SAELens's format."""

from .dictionary import Dictionary, DictionaryError, check_fits, load, save

__all__ = ["Dictionary", "DictionaryError", "check_fits", "load", "save"]
