"""An FFN rank with several attention ranks waits for each pass's device work before it
chooses the next pass (vllm.afd.ffn_runner.FFNModelRunner._settle). On one H200, 2A1F
without it served the two ranks' steps in turn, never together: the host chose the next
pass while the last one still ran on the device, when only the other rank was ready."""

from __future__ import annotations

import pytest
import torch

from vllm.afd import ffn_runner


@pytest.mark.parametrize(
    ("device", "ranks", "settles"),
    [("cuda", 2, True), ("cuda", 3, True), ("cuda", 1, False), ("cpu", 2, False)],
)
def test_passes_settle_only_on_cuda_with_several_attention_ranks(device, ranks, settles):
    assert ffn_runner.settles_passes(device, ranks) is settles


class _Stream:
    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


@pytest.mark.parametrize("settle", [True, False])
def test_settle_waits_for_the_device_work_of_the_pass(monkeypatch, settle):
    stream = _Stream()
    asked = []

    def current_stream(device):
        asked.append(device)
        return stream

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    runner = ffn_runner.FFNModelRunner.__new__(ffn_runner.FFNModelRunner)
    runner.device = torch.device("cuda", 3)
    runner._settle_passes = settle
    runner._settle()
    assert stream.syncs == int(settle)
    assert asked == ([torch.device("cuda", 3)] if settle else [])

