"""Sparse dictionaries (TopK autoencoders and transcoders) over the model's sites, in SAELens's format.

dictionary: the Dictionary, its files (save, load) and check_fits; train: training over a corpus
(``python -m tracing dictionary train``) and the held-out report; buffer: the activation buffer on
disk; sources: a site's rows and the spliced loss from a model here or on a server.
"""

from .dictionary import Dictionary, DictionaryError, check_fits, load, save
from .train import train

__all__ = ["Dictionary", "DictionaryError", "check_fits", "load", "save", "train"]
