"""The routing profile file (format 1): typed, round-tripping byte for byte, located errors, and its skew."""
from __future__ import annotations

import pytest

from headeronly import FP, PROFILE, profile_file
from planner.errors import RoutingProfileError
from planner.inputs.routing import LayerHits, RoutingProfile, dumps_profile, load_profile, profile_fingerprint, skew


def line(path, needle: str) -> int:
    text = path.read_text()
    return text[:text.index(needle)].count("\n") + 1


def error(path) -> RoutingProfileError:
    with pytest.raises(RoutingProfileError) as e:
        load_profile(path)
    return e.value


def test_the_file_is_typed_and_round_trips_byte_for_byte(tmp_path):
    path = profile_file(tmp_path)
    got = load_profile(path)
    assert got == RoutingProfile(
        checkpoint_path="ckpt", checkpoint_fingerprint=FP, prompts="prompts.txt", sequences=4, new_tokens=26,
        top_k=2, prefill_tokens=40, decode_tokens=100,
        layers={"model.layers.0.mlp.experts": LayerHits(8, (60, 0, 50, 0, 0, 45, 0, 45), (10,) * 8),
                "model.layers.1.mlp.experts": LayerHits(8, (0, 70, 0, 50, 40, 0, 40, 0), (20, 0) * 4)})
    assert (got.path, got.fingerprint) == (path, profile_fingerprint(path.read_text()))
    assert dumps_profile(got) == path.read_text()
    assert got.probabilities("model.layers.0.mlp.experts") == (0.6, 0.0, 0.5, 0.0, 0.0, 0.45, 0.0, 0.45)


def test_odd_strings_are_quoted_and_read_back(tmp_path):
    p = load_profile(profile_file(tmp_path))
    odd = RoutingProfile(**{**{k: getattr(p, k) for k in p.__dataclass_fields__ if k not in ("path", "fingerprint")},
                            "prompts": "yes: #1", "checkpoint_path": "../my model"})
    path = tmp_path / "odd.yaml"
    path.write_text(dumps_profile(odd))
    assert '  prompts: "yes: #1"\n  sequences' in path.read_text()
    assert load_profile(path) == odd


def test_schema_violations_are_located(tmp_path):
    text = PROFILE.replace("top_k: 2", "top_k: 0").replace("    experts: 8\n    decode: [0, 70",
                                                          "    experts: 8\n    hits: 1\n    decode: [0, 70")
    path = profile_file(tmp_path, text)
    e = error(path)
    assert e.headline == f"{path}: the routing profile is invalid"
    assert e.problems == [
        f"{path}:{line(path, 'hits')}:5: layers.model.layers.1.mlp.experts.hits: unknown key "
        "(allowed: experts, decode, prefill)",
        f"{path}:{line(path, 'top_k')}:10: recorded.top_k: must be at least 1, not 0"]


def test_counts_that_disagree_are_located(tmp_path):
    text = (PROFILE.replace("decode: [60, 0, 50, 0, 0, 45, 0, 45]", "decode: [60, 0, 50, 0, 0, 45, 0]")
            .replace("decode: [0, 70, 0, 50, 40, 0, 40, 0]", "decode: [0, 110, 0, 10, 40, 0, 40, 0]")
            .replace("prefill: [20, 0, 20, 0, 20, 0, 20, 0]", "prefill: [20, 0, 20, 0, 20, 0, 20, 1]"))
    path = profile_file(tmp_path, text)
    e = error(path)
    assert e.headline == (f"{path}: the routing profile is inconsistent (edited by hand?); record it again with "
                          "`plan profile`")
    at0, at1, at2 = line(path, "[60, 0"), line(path, "[0, 110"), line(path, "[20, 0")
    assert e.problems == [
        f"{path}:{at0}:13: layers.model.layers.0.mlp.experts.decode: 7 counts, but the layer has 8 experts "
        "(`experts:`)",
        f"{path}:{at0}:13: layers.model.layers.0.mlp.experts.decode: the counts add up to 155, but each of the 100 "
        "decode tokens (tokens.decode) takes 2 experts (recorded.top_k): 200",
        f"{path}:{at1}:13: layers.model.layers.1.mlp.experts.decode: expert 1 took 110 of the 100 decode tokens: a "
        "token takes an expert at most once",
        f"{path}:{at2}:14: layers.model.layers.1.mlp.experts.prefill: the counts add up to 81, but each of the 40 "
        "prefill tokens (tokens.prefill) takes 2 experts (recorded.top_k): 80"]


def test_no_decode_tokens(tmp_path):
    zeros = "[0, 0, 0, 0, 0, 0, 0, 0]"
    text = (PROFILE.replace("decode: 100", "decode: 0").replace("[60, 0, 50, 0, 0, 45, 0, 45]", zeros)
            .replace("[0, 70, 0, 50, 40, 0, 40, 0]", zeros))
    path = profile_file(tmp_path, text)
    assert error(path).problems == [
        f"{path}:{line(path, 'decode: 0')}:11: tokens.decode: no decode tokens: the cost model reads decode "
        "routing; record with `plan profile --new-tokens 2` or more"]


@pytest.mark.parametrize("content, message", [
    ("", "r.routing.yaml: a routing profile is a YAML mapping but the file is empty; record one with "
         "`plan profile CHECKPOINT -o FILE`"),
    ("format_version: 1\ncheckpoint: ./ckpt\n", "r.routing.yaml: this is a policy, not a routing profile: build "
                                                 "a plan from it with `plan build"),
    ("format_version: 1\nname: gpu\nh2d_copy_gbps: 1\n", "r.routing.yaml: this is a hardware profile, not a "
                                                         "routing profile"),
    ("- 1\n", "r.routing.yaml: a routing profile is a YAML mapping but it holds a list"),
])
def test_not_a_profile(tmp_path, content, message):
    path = tmp_path / "r.routing.yaml"
    path.write_text(content)
    assert message in str(error(path))


def test_skew():
    p = RoutingProfile("c", FP, "x", 1, 2, 2, 0, 10, {
        "a": LayerHits(10, (10, 10, 0, 0, 0, 0, 0, 0, 0, 0), (0,) * 10),
        "b": LayerHits(10, (2,) * 10, (0,) * 10)})
    s = skew(p)
    assert (s.top, s.experts, s.share, s.uniform) == (1, 10, 0.3, 0.1)
    assert s.text() == "each layer's most-hit expert (of 10) takes 30.0% of decode hits (10.0% if uniform)"


