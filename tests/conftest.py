"""Shared fixtures: the tiny config as a random model and as an FP8 checkpoint over two shards."""

from __future__ import annotations

import pytest
import torch

from model import TINY
from model.checkpoint import hf_state_dict, load_model, save_checkpoint
from model.synthetic import SyntheticSource


@pytest.fixture(scope="session")
def tiny_source() -> SyntheticSource:
    return SyntheticSource(TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_source):
    return load_model(tiny_source)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model):
    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    return save_checkpoint(hf_state_dict(tiny_model), TINY, directory, n_shards=2)


@pytest.fixture()
def tokens() -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
