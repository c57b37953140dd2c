"""The AFD handshake names the checkpoint.

An FFN rank that serves a checkpoint of the same shape as the attention's but with other
FFN weights (two fine-tunes of one base, a half-done rolling upgrade) used to pass the
handshake and apply the wrong weights, silently. Here the FFN (the offline harness,
tests/cpu/afd_proc.py) serves a copy of the attention's checkpoint in which one value of
one expert's weights differs: the attention server (`vllm serve`) must fail at start with
the fingerprint error naming the checkpoint identity of both sides, and the FFN must log
the refusal and keep waiting for its real peer.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
from harness import AfdProc, afd_json

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
START_TIMEOUT_S = 300.0
# One routed expert's weight of an MoE layer: an FFN-only tensor (the attention role
# never loads it).
TENSOR = "model.layers.1.mlp.experts.3.down_proj.weight"
MISMATCH = "AFD fingerprint mismatch on 'checkpoint'"


def perturbed_copy(src: Path, dst: Path, tensor: str) -> None:
    """``src`` copied to ``dst`` with the middle float32 value of ``tensor`` changed in place
    (same file size, same safetensors header: only that value differs)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[tensor]
        assert entry["dtype"] == "F32", entry
        begin, end = entry["data_offsets"]
        at = 8 + n + begin + ((end - begin) // 8) * 4  # the middle element
        f.seek(at)
        (value,) = struct.unpack("<f", f.read(4))
        f.seek(at)
        f.write(struct.pack("<f", value + 0.25))
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert path.stat().st_size == (src / "model.safetensors").stat().st_size


def wait_exit_or_healthy(srv: su.Server, timeout: float) -> float:
    """Seconds until ``srv`` exits or answers /health (whichever comes first)."""
    t0 = time.monotonic()
    while srv.proc.poll() is None and not srv.healthy():
        assert time.monotonic() - t0 < timeout, f"neither exited nor healthy: {srv.log_tail()}"
        time.sleep(0.5)
    return time.monotonic() - t0


def test_ffn_serving_other_ffn_weights_is_refused(model_dir, tmp_path, procs):
    other = tmp_path / "other_weights"
    perturbed_copy(model_dir, other, TENSOR)
    api_port, afd_port = su.free_ports(2)
    attn_log = tmp_path / "attention.log"
    ffn = AfdProc("ffn", other, tmp_path / "ffn.log",
                  ["--afd", afd_json("ffn", afd_port, timeout_s=START_TIMEOUT_S)],
                  env={"VLLM_AFD_SECRET": ""})  # fmt: skip
    procs.append(ffn)
    attn = None
    try:
        # Both start at once (engine start-up is mostly one thread each): the attention
        # rank retries its connect until the FFN rank listens (timeout_s 120), so its
        # hello reaches the FFN as it would once the FFN is ready.
        attn = su.Server.start(
            "attention", model_dir, api_port, attn_log,
            afd_config=su.afd_config("attention", port=afd_port, timeout_s=120),
            env={"VLLM_AFD_SECRET": ""},
        )  # fmt: skip
        ready = ffn.wait_for_log("AFD-FFN-READY", START_TIMEOUT_S)
        assert ready is not None, ffn.tail()
        took = wait_exit_or_healthy(attn, START_TIMEOUT_S)
        assert attn.proc.poll() is not None, (
            f"the attention server came up serving other FFN weights: {attn.log_tail()}"
        )
        out = attn_log.read_text(errors="replace")
        assert attn.proc.returncode != 0, out[-3000:]
        assert not attn.healthy()
        # the attention side names the refusal and both identities (the FFN's first)
        line = next((ln for ln in out.splitlines() if MISMATCH in ln), None)
        assert line is not None, out[-3000:]
        assert "refused this attention rank" in line, line
        found = re.search(r"this side has '([^']+)', the peer has '([^']+)'", line)
        assert found is not None, line
        ffn_id, attn_id = found.groups()
        assert ffn_id != attn_id
        # both are full-content identities of the same files (only one value differs)
        assert ffn_id.split(" ", 1)[1] == attn_id.split(" ", 1)[1], (ffn_id, attn_id)
        # the FFN logged its own identity at start and the refusal; it keeps waiting
        ffn_text = ffn.text()
        assert f"AFD: checkpoint identity {ffn_id}" in ffn_text, ffn_text[-3000:]
        assert f"AFD: refused attention hello: {MISMATCH}" in ffn_text, ffn_text[-3000:]
        assert f"AFD: checkpoint identity {attn_id}" in out
        assert ffn.p.poll() is None, "the FFN ended on a refused hello"
        # (item 8) the FFN states the bound of one pass at start
        assert ("AFD FFN rank 0: at most 512 tokens per pass (k=1 attention rank x 512 "
                "max_num_batched_tokens = 512)") in ffn_text  # fmt: skip
        print(f"attention server exited (rc={attn.proc.returncode}) {took:.1f} s after it "
              f"started: {line.strip()[-260:]}")  # fmt: skip
    finally:
        su.stop_servers([attn])
