# SPDX-License-Identifier: Apache-2.0
"""When the attention role opens a step: at the model's forward (a pre-hook,
connector_extra_config.early_step_control, the default) or at its first remote
layer (the key false, micro-batched steps, a failed early opening)."""

from __future__ import annotations

import pytest
import torch

from vllm.afd import attention
from vllm.afd.attention import AttentionClient
from vllm.afd.protocol import AFDPeerError, AFDProtocolError

HIDDEN = 4


class Recorder:
    """A connector that logs what the client does and answers every layer with 2x."""

    def __init__(self, fail_begin: int = 0):
        self.calls: list[tuple] = []
        self.fail_begin = fail_begin

    def begin_step(self, step_id, num_tokens, ubatch=None, ubatch_tokens=None):
        if self.fail_begin:
            self.fail_begin -= 1
            raise AFDPeerError("peer lost")
        self.calls.append(("begin", step_id, num_tokens))

    def send(self, x):
        self.calls.append(("send", x.shape[0]))
        self.last = x

    def recv(self, out):
        return out.copy_(2 * self.last)

    def end_step(self):
        self.calls.append(("end",))


def client(conn: Recorder, layers: int = 2, early: bool = True) -> AttentionClient:
    c = AttentionClient()
    for i in range(layers):
        c.register(i)
    c.connector = conn
    c.early_control = early
    return c


def forward(c: AttentionClient, tokens: int, early_tokens: int | None = None) -> None:
    """One model forward: the pre-hook (with ``early_tokens``), then every layer."""
    c.begin_forward(tokens if early_tokens is None else early_tokens)
    x = torch.randn(tokens, HIDDEN)
    for i in sorted(c.layers):
        assert torch.equal(c.exchange(x, i), 2 * x)


def test_the_forward_opens_the_step_once_before_its_first_layer():
    conn = Recorder()
    c = client(conn)
    c.begin_forward(3)
    assert conn.calls == [("begin", 1, 3)]  # before any layer ran
    x = torch.randn(3, HIDDEN)
    c.exchange(x, 0)
    c.exchange(x, 1)
    forward(c, 5)
    assert conn.calls == [("begin", 1, 3), ("send", 3), ("send", 3), ("end",),
                          ("begin", 2, 5), ("send", 5), ("send", 5), ("end",)]  # fmt: skip


def test_without_early_control_the_first_layer_opens_the_step():
    conn = Recorder()
    c = client(conn, early=False)
    c.begin_forward(3)
    assert conn.calls == []
    forward(c, 3)
    assert conn.calls == [("begin", 1, 3), ("send", 3), ("send", 3), ("end",)]


def test_a_forward_that_ended_early_leaves_no_step_open_for_the_next():
    """A forward that opened its step and never reached a layer (it failed): the next
    forward opens a step of its own, with a new step id."""
    conn = Recorder()
    c = client(conn)
    c.begin_forward(3)
    forward(c, 3)
    assert [k for k in conn.calls if k[0] == "begin"] == [("begin", 1, 3), ("begin", 2, 3)]


def test_a_failed_early_opening_is_left_to_the_first_layer():
    """A lost peer at the forward's start is not raised there: the first layer opens the
    step again, where a lost peer is rejoined (vllm.afd.rejoin)."""
    conn = Recorder(fail_begin=1)
    c = client(conn)
    forward(c, 3)
    assert conn.calls[0] == ("begin", 2, 3) and conn.calls.count(("send", 3)) == 2


def test_token_counts_that_differ_are_a_clear_error():
    c = client(Recorder())
    with pytest.raises(AFDProtocolError, match="opened a step of 4 tokens, its first remote "
                       "FFN layer has 3; set connector_extra_config.early_step_control"):
        forward(c, 3, early_tokens=4)


class Model(torch.nn.Module):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return positions


def test_the_pre_hook_counts_the_tokens_of_the_model_inputs(monkeypatch):
    conn = Recorder()
    monkeypatch.setattr(attention, "CLIENT", client(conn))
    model = Model()
    attention.open_steps_at_forward(model)
    attention.open_steps_at_forward(model)  # a second load: still one hook
    model(input_ids=torch.zeros(7, dtype=torch.long), positions=torch.arange(7))
    model(torch.zeros(2, dtype=torch.long), torch.arange(2))
    model(input_ids=None, positions=torch.zeros(3, 6), inputs_embeds=torch.zeros(6, HIDDEN))
    # a later pipeline stage opens its step at its first remote layer
    model(input_ids=None, positions=torch.arange(5), intermediate_tensors={"h": 1})
    assert conn.calls == [("begin", 1, 7), ("begin", 2, 2), ("begin", 3, 6)]
