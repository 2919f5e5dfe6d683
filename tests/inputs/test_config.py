"""planner/inputs/config.py: the facts of config.json, and a config.json that cannot give them."""
from __future__ import annotations

import json

import pytest

from planner.errors import CheckpointError
from planner.inputs.config import ModelFacts, read_config


def test_read_config(tmp_path):
    assert read_config(tmp_path) == ModelFacts()
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 8}))
    assert read_config(tmp_path).top_k == 8
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"moe_topk": 6, "num_hidden_layers": 28},
                                                      "vision_config": {"depth": 32}, "num_hidden_layers": 99}))
    assert read_config(tmp_path) == ModelFacts(top_k=6, layers=28, vision=True)  # the text model's facts win
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "num_nextn_predict_layers": 1}))
    assert read_config(tmp_path) == ModelFacts(layers=61, mtp_layers=1)
    for text, why in (("[1, 2]", "a JSON list, not an object"), ("{bad", "not valid JSON"),
                      ('{"num_experts_per_tok": "eight"}', "num_experts_per_tok: 'eight': a whole number was expected")):
        (tmp_path / "config.json").write_text(text)  # planned without it, every expert would count as read
        with pytest.raises(CheckpointError, match=f"config.json: {why}"):
            read_config(tmp_path)
