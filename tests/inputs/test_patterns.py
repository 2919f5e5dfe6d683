"""Parameter patterns: vLLM's segment semantics, `re:` regexes, and patterns that match nothing."""
from __future__ import annotations

import re

import pytest

from headeronly import toy, write_policy
from planner.decide.build import build, check_patterns
from planner.errors import PolicyError
from planner.inputs.patterns import closest, compile_pattern
from planner.inputs.policy import load_policy
from synthetic import qwen3_moe, write_header_only


@pytest.mark.parametrize("pattern, name, hit", [
    ("experts", "mlp.experts.w2_weight", True),
    ("experts.w2_weight", "mlp.experts.w2_weight", True),
    ("mlp.experts.w2_weight", "mlp.experts.w2_weight", True),
    ("expert", "mlp.experts.w2_weight", False),
    ("w2", "mlp.experts.w2_weight", False),
    ("w2_weight", "mlp.experts.w2_weight_scale", False),
    ("w2_weight", "mlp.experts.w2_weight", True),
    ("mlp.w2_weight", "mlp.experts.w2_weight", False),  # segments must be adjacent
    ("layers.1", "model.layers.10.mlp", False),
    ("layers.1", "model.layers.1.mlp", True),
])
def test_vllm_segment_matching(pattern, name, hit):
    assert compile_pattern(pattern).matches(name) is hit
    assert (f".{pattern}." in f".{name}.") is hit  # vLLM's own test, verbatim


def test_regex_patterns_search_the_name():
    names = ("model.layers.1.mlp.w", "model.layers.2.mlp.w", "model.layers.13.mlp.w")
    # A regex is searched, not matched segment-wise: `layers\.1` also hits layer 13.
    assert [n for n in names if compile_pattern(r"re:layers\.1").matches(n)] == [names[0], names[2]]
    assert [n for n in names if compile_pattern(r"re:layers\.(1|2)\.").matches(n)] == [names[0], names[1]]
    assert compile_pattern(r"re:^lm_head\.").matches("lm_head.weight")
    assert not compile_pattern(r"re:^head").matches("lm_head.weight")
    with pytest.raises(re.error):
        compile_pattern("re:(")


def test_closest_folds_numbers():
    names = [n for n, _, _ in qwen3_moe(layers=2, experts=4, vocab=64, hidden=32)]
    assert closest("dwon_proj", names) == ["down_proj", "o_proj", "v_proj"]
    assert closest("self_atn", names) == ["self_attn"]
    # Suggestions are real runs of real names (numbers unfolded), so each one matches.
    assert closest("experts.down_prj", names) == ["0.down_proj", "experts.0"]
    assert closest("layer", names) == ["layers"]
    assert closest("zzzz", names) == []


def test_pattern_matching_nothing_is_an_error_with_location_and_suggestion(tmp_path):
    write_header_only(tmp_path / "ckpt", toy(2), single=True)
    path = write_policy(tmp_path, (
        "uva:\n"
        "  offload_gib: 1\n"
        "  params: [mlp, dwon_proj]\n"
        "rules:\n"
        "  - match: [embed_tokens, 're:^nothing']\n"
        "    place: gpu\n"))
    pol = load_policy(path)
    with pytest.raises(PolicyError) as e:
        build(pol, tmp_path)
    assert e.value.headline == f"{path}: patterns that match nothing"
    assert e.value.problems == [
        f"{path}:5:17: uva.params[1]: 'dwon_proj' matches no tensor of the checkpoint; "
        "did you mean 'down_proj' or 'o_proj'?",
        f"{path}:7:27: rules[0].match[1]: 're:^nothing' matches no tensor of the checkpoint",
    ]


def test_check_patterns_accepts_matching_patterns(tmp_path):
    write_header_only(tmp_path / "ckpt", toy(2), single=True)
    path = write_policy(tmp_path, "uva:\n  params: [mlp.down_proj, 're:o_proj']\n")
    check_patterns(load_policy(path), [n for n, _, _ in toy(2)])
