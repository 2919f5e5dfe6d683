"""The policy file: YAML -> JSON Schema -> typed Policy, with located errors and cross-field checks."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jsonschema
import pytest

from headeronly import write_policy
from planner.errors import PolicyError
from planner.inputs.patterns import compile_pattern
from planner.inputs.policy import Policy, PrefetchPolicy, Rule, UvaPolicy, Workload, load_policy
from planner.plan import Backend, Placement

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def policy_error(path) -> PolicyError:
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    return e.value


def test_a_full_policy_is_typed(tmp_path):
    body = ("backend: prefetch\n"
            "budget_gib: 40\n"
            "stacks: [model.layers]\n"
            "uva:\n  offload_gib: 0\n  params: []\n"
            "prefetch:\n  group_size: 8.0\n  num_in_group: 2\n  step: 2\n  params: [experts, 're:mlp\\.gate']\n"
            "rules:\n  - match: [embed_tokens, lm_head]\n    place: gpu\n")
    path = write_policy(tmp_path, body)
    got = load_policy(path)
    assert got == Policy(
        path=path,
        fingerprint="sha256:" + hashlib.sha256(path.read_bytes()).hexdigest(),
        checkpoint=tmp_path / "./ckpt",
        checkpoint_text="./ckpt",
        backend=Backend.PREFETCH,
        budget_gib=40,
        stacks=("model.layers",),
        uva=UvaPolicy(0, ()),
        prefetch=PrefetchPolicy(8, 2, 2, (compile_pattern("experts"), compile_pattern(r"re:mlp\.gate"))),
        rules=(Rule((compile_pattern("embed_tokens"), compile_pattern("lm_head")), Placement.GPU),),
    )
    assert type(got.prefetch.group_size) is int
    assert got.budget_bytes == 40 * 2**30
    assert got.warnings == ()
    assert got.where("prefetch.params[1]") == f"{path}:13:21"
    assert got.where("stacks[0]") == f"{path}:5:10"
    assert got.where("no.such.key") == str(path)
    assert [k for k, _ in got.all_patterns()] == [
        "prefetch.params[0]", "prefetch.params[1]", "rules[0].match[0]", "rules[0].match[1]"]


def test_defaults(tmp_path):
    got = load_policy(write_policy(tmp_path))
    assert (got.backend, got.budget_gib, got.budget_bytes, got.stacks, got.uva, got.prefetch, got.rules) == (
        Backend.AUTO, None, None, None, UvaPolicy(), PrefetchPolicy(), ())


def test_checkpoint_path_is_relative_to_the_policy(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    path = write_policy(tmp_path / "sub", head="format_version: 1\ncheckpoint: ../models/x\n")
    monkeypatch.chdir(tmp_path / "sub")
    assert load_policy(path).checkpoint == tmp_path / "sub" / "../models/x"
    path = write_policy(tmp_path, head=f"format_version: 1\ncheckpoint: {tmp_path}/abs\n")
    assert load_policy(path).checkpoint == tmp_path / "abs"


def test_yaml_syntax_error_is_located(tmp_path):
    path = write_policy(tmp_path, "uva:\n  offload_gib: [1\nbackend: uva\n")
    e = policy_error(path)
    assert str(e) == f"{path}:5:8: invalid YAML: did not find expected ',' or ']'"
    path = write_policy(tmp_path, "uva:\n\toffload_gib: 1\n")
    assert str(policy_error(path)) == (f"{path}:4:1: a tab in the indentation: YAML indents with spaces only; "
                                       "replace the tab with spaces")


def test_schema_violations_are_all_located_with_key_paths(tmp_path):
    path = write_policy(tmp_path, head="format_version: 2\ncheckpoint: ./ckpt\n", body=(
        "backend: gpu\n"
        "budget_gb: 4\n"
        "uva:\n  offload_gib: -1\n  params: mlp\n"
        "prefetch:\n  group_sise: 8\n  step: two\n"
        "rules:\n  - match: [x]\n    place: disk\n  - place: gpu\n"
        "zzz: 1\n"))
    e = policy_error(path)
    assert e.headline == f"{path}: the policy is invalid"
    assert e.problems == [
        f"{path}:4:1: budget_gb: unknown key; did you mean 'budget_gib'?",
        f"{path}:15:1: zzz: unknown key (allowed: format_version, checkpoint, backend, budget_gib, "
        "gpus, parallel, hardware, cpu_experts, workload, stacks, uva, prefetch, rules)",
        f"{path}:3:10: backend: 'gpu' is not one of auto, uva, prefetch, mixed",
        f"{path}:1:17: format_version: must be 1, not 2",
        f"{path}:9:3: prefetch.group_sise: unknown key; did you mean 'group_size'?",
        f"{path}:10:9: prefetch.step: must be a whole number, not 'two'",
        f"{path}:13:12: rules[0].place: 'disk' is not one of gpu, uva, prefetch, cpu",
        f"{path}:14:5: rules[1]: 'match' is required",
        f"{path}:6:16: uva.offload_gib: must be at least 0, not -1",
        f"{path}:7:11: uva.params: must be a list, not 'mlp'",
    ]


def test_required_keys_and_shape(tmp_path):
    path = write_policy(tmp_path, head="format_version: 1\n")
    assert policy_error(path).problems == [f"{path}:1:1: (top level): 'checkpoint' is required"]
    path = write_policy(tmp_path, head="- 1\n")
    assert str(policy_error(path)) == (f"{path}: a policy is a YAML mapping but it holds a list; start with "
                                       "`format_version: 1` and `checkpoint: DIR`")
    assert str(policy_error(tmp_path / "none.yaml")) == f"{tmp_path / 'none.yaml'}: no such policy file"


def test_bad_regex_is_located(tmp_path):
    path = write_policy(tmp_path, "rules:\n  - match: [ok, 're:(']\n    place: gpu\n")
    assert policy_error(path).problems == [
        f"{path}:4:17: rules[0].match[1]: bad regular expression '(': "
        "missing ), unterminated subpattern at position 0"]


def test_num_in_group_above_group_size_and_step_zero(tmp_path):
    path = write_policy(tmp_path, "prefetch:\n  group_size: 2\n  num_in_group: 3\n  step: 0\n")
    e = policy_error(path)
    assert e.problems == [
        f"{path}:5:17: prefetch.num_in_group (3) must be <= prefetch.group_size (2)",
        f"{path}:6:9: prefetch.step must be >= 1 when prefetch is on (it is 0)",
    ]


@pytest.mark.parametrize("body", [
    "backend: prefetch\nbudget_gib: 1\nprefetch:\n  step: 0\n",
    "prefetch:\n  group_size: 4\n  step: 0\n",
])
def test_step_zero_is_an_error_whenever_prefetch_is_on(tmp_path, body):
    path = write_policy(tmp_path, body)
    (msg,) = policy_error(path).problems
    assert msg.endswith("prefetch.step must be >= 1 when prefetch is on (it is 0)")


def test_step_zero_is_fine_when_prefetch_is_off(tmp_path):
    path = write_policy(tmp_path, "backend: uva\nuva:\n  offload_gib: 1\nprefetch:\n  step: 0\n")
    assert load_policy(path).prefetch.step == 0


@pytest.mark.parametrize("body, warning", [
    ("backend: uva\nprefetch:\n  group_size: 8\n",
     "4:1: prefetch.* is set but backend is uva; it is ignored"),
    ("backend: uva\nprefetch:\n  step: 2\n",
     "4:1: prefetch.* is set but backend is uva; it is ignored"),
    ("backend: prefetch\nuva:\n  params: [mlp]\nprefetch:\n  group_size: 8\n",
     "4:1: uva.* is set but backend is prefetch; it is ignored"),
    ("uva:\n  offload_gib: 4\nprefetch:\n  group_size: 8\n",
     "3:1: both uva.* and prefetch.group_size are set under backend: auto; prefetch wins and uva.* "
     "is ignored"),
    ("uva:\n  offload_gib: 4\nprefetch:\n  params: [mlp]\n",
     "5:1: prefetch.* is set but backend auto only prefetches when prefetch.group_size > 0; it is "
     "ignored (set group_size, or `backend: prefetch` to let budget_gib choose the layers)"),
    ("uva:\n  params: [self_attn]\n",
     "4:3: uva.params is set but no amount (uva.offload_gib or budget_gib): it picks the candidates only, so it "
     "offloads nothing; set one"),
])
def test_warnings_for_the_other_backends_fields(tmp_path, body, warning):
    path = write_policy(tmp_path, body)
    got = load_policy(path)
    assert got.warnings == (f"{path}:{warning}",)


@pytest.mark.parametrize("body", [
    "uva:\n  offload_gib: 4\n",
    "prefetch:\n  group_size: 8\n  num_in_group: 2\n  step: 3\n",
    "backend: uva\nuva:\n  offload_gib: 0\nprefetch:\n  group_size: 0\n",
    "budget_gib: 4\nuva:\n  params: [mlp]\n",
    "gpus: [4, 5]\nuva:\n  params: [mlp]\n",
])
def test_no_warnings(tmp_path, body):
    assert load_policy(write_policy(tmp_path, body)).warnings == ()


def test_fingerprint_is_the_files_bytes(tmp_path):
    a = load_policy(write_policy(tmp_path, "budget_gib: 4\n", name="a.yaml"))
    b = load_policy(write_policy(tmp_path, "budget_gib: 4  # a comment\n", name="b.yaml"))
    for p in (a, b):
        assert p.fingerprint == "sha256:" + hashlib.sha256(p.path.read_bytes()).hexdigest()
    assert a.fingerprint != b.fingerprint and a.budget_gib == b.budget_gib == 4


def test_schema_is_draft_2020_12_and_documents_every_field():
    for name in ("policy.schema.json", "plan.schema.json"):
        schema = json.loads((SCHEMAS / name).read_text())
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(schema)
    policy = json.loads((SCHEMAS / "policy.schema.json").read_text())
    for key, sub in policy["properties"].items():
        assert sub.get("description"), key
        for field, spec in sub.get("properties", {}).items():
            if key != "rules":
                assert spec.get("description"), f"{key}.{field}"


def test_prefill_fields_default_and_parse(tmp_path):
    got = load_policy(write_policy(tmp_path))
    assert (got.workload.prompt_tokens, got.workload.new_tokens, got.uva.stage_prefill) == (512, 256, True)
    got = load_policy(write_policy(tmp_path, "workload: {prompt_tokens: 2048.0, new_tokens: 64}\n"
                                             "uva: {stage_prefill: false}\n"))
    assert (got.workload, got.uva) == (Workload(prompt_tokens=2048, new_tokens=64), UvaPolicy(stage_prefill=False))
    assert type(got.workload.prompt_tokens) is int


@pytest.mark.parametrize("body", ["backend: prefetch\nbudget_gib: 1\nuva: {stage_prefill: false}\n",
                                  "backend: mixed\nbudget_gib: 1\nuva: {stage_prefill: false}\n"])
def test_stage_prefill_is_no_backend_knob_so_no_backend_ignores_it(tmp_path, body):
    """It applies to whatever placed tensors on uva (rules, mixed), so it is never "ignored"."""
    assert load_policy(write_policy(tmp_path, body)).warnings == ()
