"""The AFD attention role's profiler hook: with DBO the micro-batch threads are recorded."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from vllm.afd import engine


def _worker(enable_dbo: bool):
    prof = profile(activities=[ProfilerActivity.CPU])
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(enable_dbo=enable_dbo))
    return SimpleNamespace(vllm_config=cfg, profiler=SimpleNamespace(profiler=prof)), prof


def _spans_seen(prof) -> int:
    def ubatch():
        with record_function("afd.send"):
            torch.ones(8).sum()

    prof.start()
    t = threading.Thread(target=ubatch)
    t.start()
    t.join()
    prof.stop()
    return sum(1 for e in prof.events() if e.name == "afd.send")


@pytest.mark.parametrize("dbo", [False, True])
def test_dbo_makes_the_worker_profiler_record_other_threads(dbo):
    worker, prof = _worker(dbo)
    engine._profile_all_threads(worker)
    assert (prof.experimental_config is not None) == dbo
    # a span of another thread (a micro-batch thread) is in the trace only with DBO
    assert _spans_seen(prof) == (1 if dbo else 0)


def test_a_profiler_with_its_own_config_or_none_is_left_alone():
    from torch._C._profiler import _ExperimentalConfig

    worker, prof = _worker(True)
    own = _ExperimentalConfig(verbose=True)
    prof.experimental_config = own
    engine._profile_all_threads(worker)
    assert prof.experimental_config is own
    worker.profiler = None  # the GPU worker builds its profiler later
    engine._profile_all_threads(worker)
