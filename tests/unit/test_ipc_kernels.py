"""The cuda_ipc connector's choice between fused and split hand-over kernels
(vllm.distributed.afd.cuda_ipc.send_message / recv_message), without a GPU: which path
a message takes, and what each path hands the kernels. tests/gpu/test_gpu_ipc_connector.py
runs both paths on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.afd import cuda_ipc, ipc_kernels


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for name in ("send_fused", "recv_fused", "signal", "wait"):
        monkeypatch.setattr(ipc_kernels, name,
                            lambda *args, _n=name: seen.append((_n, args)))  # fmt: skip
    return seen


def _msg(n=64, dtype=torch.bfloat16):
    return torch.arange(n, dtype=torch.float32).to(dtype)


def test_fused_path_is_one_kernel_each_way(calls):
    src, dst = _msg(), torch.zeros(64, dtype=torch.bfloat16)
    ctr, flag, err, done = (torch.zeros(8, dtype=torch.int64) for _ in range(4))
    cuda_ipc.send_message(src, dst, ctr, flag, done, fused=True)
    cuda_ipc.recv_message(src, dst, ctr, flag, err, done, 5, fused=True)
    assert [c[0] for c in calls] == ["send_fused", "recv_fused"]
    assert calls[0][1][:2] == (src, dst) and calls[1][1][-1] == 5
    assert not torch.equal(src, dst)  # the copy is the kernel's (stubbed here)


def test_split_path_copies_with_torch_and_signals(calls):
    src, dst = _msg(), torch.zeros(64, dtype=torch.bfloat16)
    ctr, flag, err, done = (torch.zeros(8, dtype=torch.int64) for _ in range(4))
    cuda_ipc.send_message(src, dst, ctr, flag, done, fused=False)
    assert torch.equal(src, dst) and [c[0] for c in calls] == ["signal"]
    out = torch.zeros(64, dtype=torch.bfloat16)
    cuda_ipc.recv_message(src, out, ctr, flag, err, done, 5, fused=False)
    assert torch.equal(out, src) and [c[0] for c in calls] == ["signal", "wait"]


def test_messages_the_fused_kernels_cannot_copy_take_the_split_path(calls):
    odd = torch.zeros(3, dtype=torch.bfloat16)  # 6 bytes: not whole 4-byte words
    assert not ipc_kernels.fusable(odd, torch.zeros(3, dtype=torch.bfloat16))
    assert not ipc_kernels.fusable(_msg(), torch.zeros(32, dtype=torch.bfloat16))  # sizes differ
    assert not ipc_kernels.fusable(_msg(128).view(64, 2)[:, 0], torch.zeros(64, dtype=torch.bfloat16))
    assert ipc_kernels.fusable(_msg(), torch.zeros(32, dtype=torch.float32))  # same bytes
    ctr, flag, done = (torch.zeros(8, dtype=torch.int64) for _ in range(3))
    cuda_ipc.send_message(odd, torch.ones(3, dtype=torch.bfloat16), ctr, flag, done, fused=True)
    assert [c[0] for c in calls] == ["signal"]


def test_ipc_fused_kernels_defaults_on_and_can_be_turned_off():
    def ctx(extra):
        return SimpleNamespace(config=SimpleNamespace(connector_extra_config=extra))

    assert cuda_ipc.fused_kernels(ctx({})) is True
    assert cuda_ipc.fused_kernels(ctx({"ipc_fused_kernels": False})) is False
