"""The corpus atlas: routing and sparse attention counted over a corpus (``python -m tracing atlas``).

build: the job (batches, checkpoints, resuming, ranks) and the atlas files; counts: the hooks that
count each batch and drop it; tables: the counts as tidy tables; corpus: the texts, tokenised into
sequences.
"""

from .build import Atlas, AtlasError, AtlasJob, build_atlas, read_atlas

__all__ = ["Atlas", "AtlasError", "AtlasJob", "build_atlas", "read_atlas"]
