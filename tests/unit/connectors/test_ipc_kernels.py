"""The cuda_ipc connector's hand-over (vllm.distributed.afd.cuda_ipc.send_message /
recv_message) without a GPU: the copy and the device kernels it hands the message to, and
the device index its exported buffers are allocated on. tests/gpu/test_gpu_ipc_connector.py
runs them on a GPU; here the kernels themselves run in Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.distributed.afd import cuda_ipc, ipc_kernels


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for name in ("signal", "wait"):
        monkeypatch.setattr(ipc_kernels, name, lambda *args, _n=name: seen.append((_n, args)))
    return seen


def test_a_message_is_copied_then_signalled_and_waited_for_then_copied(calls):
    src, dst = torch.arange(64, dtype=torch.float32).to(torch.bfloat16), torch.zeros(64)
    dst = dst.to(torch.bfloat16)
    ctr, flag, err = (torch.zeros(8, dtype=torch.int64) for _ in range(3))
    cuda_ipc.send_message(src, dst, ctr, flag)
    assert torch.equal(src, dst) and calls == [("signal", (ctr, flag))]
    out = torch.zeros(64, dtype=torch.bfloat16)
    cuda_ipc.recv_message(dst, out, ctr, flag, err, 5)
    assert torch.equal(out, src) and calls[1] == ("wait", (ctr, flag, err, 5))


def test_a_cuda_device_without_an_index_gets_the_current_one(monkeypatch):
    # vLLM's device config says "cuda"; torch.cuda.use_mem_pool refuses a device without an
    # index (seen on an H200: "Expected a torch.device with a specified index").
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_ipc.indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert cuda_ipc.indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert cuda_ipc.indexed(torch.device("cpu")) == torch.device("cpu")


def test_the_kernels_write_their_words_in_triton_s_interpreter():
    """The signal and control kernels, direct and through the pointer table, for real in
    Triton's CPU interpreter (chosen before triton compiles them: a child process).
    ``wait`` reads ``globaltimer``, which the interpreter lacks: it runs on a GPU only."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import overlay_import; "
            "overlay_import.install(); import test_ipc_kernels as t; t.interpreted_kernels()")  # fmt: skip
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", code, str(tests), here], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("kernels: ok")


def _words(n: int) -> torch.Tensor:
    return torch.full((n,), -1, dtype=torch.int64)  # -1: a word no kernel wrote


def interpreted_kernels() -> None:
    ctr, flag = torch.zeros(8, dtype=torch.int64), _words(8)
    ipc_kernels.signal(ctr, flag)
    ipc_kernels.signal(ctr, flag)
    assert ctr[0] == 2 and flag.tolist() == [2] + [-1] * 7, (ctr, flag)
    row = _words(8)
    ipc_kernels.control(ctr, row, 5, 3, 7)
    assert ctr[0] == 3 and row.tolist() == [3, 3, 5, 3, -1, -1, 7, -1], row
    peer, inbox = _words(16), torch.zeros(64, dtype=torch.bfloat16)
    table = torch.tensor([peer.data_ptr(), inbox.data_ptr()], dtype=torch.int64)
    ipc_kernels.signal_via(ctr, table, 9)
    assert ctr[0] == 4 and peer.tolist() == [-1] * 9 + [4] + [-1] * 6, peer
    ipc_kernels.control_via(ctr, table, 11, 1, 2)
    assert ctr[0] == 5 and peer[:8].tolist() == [5, 5, 11, 1, -1, -1, 2, -1], peer
    assert peer[9] == 4  # the earlier signal's word stays
    src = torch.arange(8, dtype=torch.float32).to(torch.bfloat16)
    ipc_kernels.copy_via(src, table, 32)  # byte 32: element 16
    assert torch.equal(inbox[16:24], src) and not inbox[:16].any() and not inbox[24:].any()
    print("kernels: ok")
