"""The cuda_ipc connector's hand-over (vllm.distributed.afd.cuda_ipc.send_message /
recv_message) without a GPU: the copy and the device kernels it hands the message to, and
the device index its exported buffers are allocated on. tests/gpu/test_gpu_ipc_connector.py
runs them on a GPU."""

from __future__ import annotations

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
