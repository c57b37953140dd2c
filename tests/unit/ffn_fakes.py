"""The FFN rank's serve-loop code on CPU tensors without a model, shared by the unit tests of
vllm.afd.ffn_runner (pass bound, micro-batched steps, ping-pong between ranks, the loss of a
rank in a step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

from vllm.afd import ffn_runner


class FakeRunner(ffn_runner.FFNModelRunner):
    """FFNModelRunner's step code with ``layers`` blocks, layer i computing ``block(x, i)``
    (x * 10 + i unless given); ``rows_per_call`` records the rows of every block call."""

    def __init__(
        self,
        conn,
        layers: int = 2,
        hidden: int = 4,
        max_pass_tokens: int = 64,
        block: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        schedule: str = "join",
    ):
        self.connector = conn
        self.rows_per_call: list[int] = []
        block = block or (lambda x, i: x * 10 + i)

        def call(x, i):
            self.rows_per_call.append(x.shape[0])
            return block(x, i)

        self.modules = {i: (lambda x, i=i: call(x, i)) for i in range(layers)}
        self.gates = {}
        self.dtype, self.hidden_size, self.device = torch.float32, hidden, torch.device("cpu")
        self.vllm_config = None
        self._sync_timing = False
        self._settle_passes = False
        self.steps_served = self.batched_steps = self.ubatched_steps = 0
        self.schedule, self.pingpong_steps = schedule, 0
        self._auto, self._auto_last = ffn_runner.AutoSchedule(), None
        self.graphs_enabled = self.layer_graphs_enabled = False
        self.profiler = None
        self.max_pass_tokens = max_pass_tokens
        self._pending, self.split_steps = [], 0
        self._lost, self.peers_lost = set(), 0
        self._tasks, self.straggler_splits = [], 0


@pytest.fixture
def no_forward_context(monkeypatch):
    """The blocks run outside vLLM's forward context (they are no vLLM layers)."""
    import vllm.forward_context as fc

    monkeypatch.setattr(fc, "set_forward_context", lambda *a, **k: contextlib.nullcontext())
