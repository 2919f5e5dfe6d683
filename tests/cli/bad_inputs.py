"""Bad input, written: each builder returns `setup(work)`, which writes one bad file into the working directory
of test_bad_input.py's corpus (and returns the `{spots}` its message names); `snapshot` records a directory, so
that a test can show nothing in it changed."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

HEAD = "format_version: 1\ncheckpoint: ./ckpt\n"
POLICY = HEAD + "budget_gib: 0.015\n"  # offloads every layer of the toy checkpoint through uva, staged at prefill
HARDWARE = ("format_version: 1\nname: test GPU\nh2d_copy_gbps: 55.0\nuva_read_gbps: 50.0\nhbm_read_gbps: 2900\n"
            "layer_overhead_us: 800.0\n")


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `directory` (links not followed): (mode, size, mtime in ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(directory))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def plan_text(work: Path, old: str, new: str) -> str:
    text = (work / "p.plan.yaml").read_text()
    assert old in text, old
    return text.replace(old, new, 1)


def edited_plan(old: str, new: str, **spots: str):
    """Write bad.plan.yaml, the plan with `old` replaced by `new`. The plan's layout belongs to
    `plan build`, so messages name places by text: `{at}` in a message is `line:column` of the
    string spots["at"] in the edited file (`{first}` likewise)."""
    def setup(w):
        text = plan_text(w, old, new)
        (w / "bad.plan.yaml").write_text(text)
        return {name: where(text, s) for name, s in spots.items()}
    return setup


def where(text: str, s: str) -> str:
    assert text.count(s) == 1, s
    before = text[: text.index(s)]
    return f"{before.count(chr(10)) + 1}:{len(before) - before.rfind(chr(10))}"


def policy(body: str, head: str = HEAD, name: str = "bad.policy.yaml"):
    def setup(w):
        (w / name).write_text(head + body)
    return setup


def hardware(old: str, new: str):
    def setup(w):
        assert old in HARDWARE
        (w / "bad-hw.yaml").write_text(HARDWARE.replace(old, new))
        (w / "bad.policy.yaml").write_text(HEAD + "budget_gib: 0.018\nhardware: bad-hw.yaml\n")
    return setup


def socket_file(w):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(w / "sock.yaml"))
    s.close()


def routing_profile(body: str):
    """bad.policy.yaml naming r.yaml: a valid routing profile, of a model with one MoE layer of 2 experts."""
    def setup(w):
        (w / "r.yaml").write_text(
            "format_version: 1\ncheckpoint: {path: other, fingerprint: \"sha256:" + "0" * 64 + "\"}\n"
            "recorded: {prompts: x, sequences: 1, new_tokens: 2, top_k: 1}\ntokens: {prefill: 2, decode: 1}\n"
            "layers:\n  model.layers.0.mlp.experts: {experts: 2, decode: [1, 0], prefill: [1, 1]}\n")
        (w / "bad.policy.yaml").write_text(HEAD + body)
    return setup


def fp8_checkpoint(scale_shape: tuple[int, ...]):
    """bad.policy.yaml naming fp8/: a header-only FP8 checkpoint whose one weight [256, 128] has scales of
    `scale_shape` (block-scaled: [2, 1]), and a norm."""
    def setup(w):
        from synthetic import write_header_only
        name = "model.layers.0.self_attn.q_proj.weight"
        write_header_only(w / "fp8", [("model.layers.0.input_layernorm.weight", "BF16", (128,)),
                                      (name, "F8_E4M3", (256, 128)), (name + "_scale_inv", "F32", scale_shape)])
        (w / "bad.policy.yaml").write_text("format_version: 1\ncheckpoint: ./fp8\n")
    return setup


def write(name: str, data: bytes):
    def setup(w):
        (w / name).write_bytes(data)
    return setup


def nothing(w):
    pass


def case(name: str, setup, argv: list[str], message: str, marks=()):
    """One bad input: setup(work) writes it, `plan *argv` reads it, stderr holds `message`."""
    return pytest.param(setup, argv, message, id=name, marks=marks)
