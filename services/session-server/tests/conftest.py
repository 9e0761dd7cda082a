"""A tokenizer directory like the default model's (BPE + ChatML template), trained without torch."""

from __future__ import annotations

import json

import pytest

from rlfleet.engine.build_model import tokenizer_config, train_tokenizer
from rlfleet.engine.testing import calc_dialogues


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(calc_dialogues(300), 512).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(1024)))
    return out
