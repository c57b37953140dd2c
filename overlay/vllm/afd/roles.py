# SPDX-License-Identifier: Apache-2.0
"""Role helpers of AFD: the AFD configuration of a vLLM config, which role this
process plays, the CUDA-graph capture guard, and the order of the exit hooks.

Every AFD module may import this one: it imports no other AFD module but the
configuration (``vllm.config.afd``), so the roles (``attention``,
``model_split``, ``ffn_runner``, ``engine``) and the connectors
(``vllm.distributed.afd``) share these helpers without importing each other.
"""

from __future__ import annotations

import contextlib
import threading

from vllm.config.afd import AFDConfig

# The order of the AFD exit hooks (``multiprocessing.util.Finalize`` priorities, highest
# first). Multiprocessing's exit hook runs in the main process (at atexit) and in every
# multiprocessing child, forked ones included: those end with ``os._exit`` and run no
# atexit hook (vLLM's engine core on a GPU host is one). First a data plane's last report
# (its proxy threads' figures), then the attention role's goodbye to its FFN ranks, last
# the removal of the process's metrics snapshot (which the closing before it updates).
EXIT_PLANE_REPORT = 10
EXIT_ROLE_CLOSE = 5
EXIT_METRICS_REMOVAL = 1


def current_vllm_config():
    """The vLLM config being built or served in this process, or None."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def afd_config(vllm_config=None) -> AFDConfig | None:
    """The AFD configuration of ``vllm_config`` (default: the current vLLM
    config); None without AFD."""
    if vllm_config is None:
        vllm_config = current_vllm_config()
    return getattr(vllm_config, "afd_config", None) if vllm_config is not None else None


def is_ffn(vllm_config=None) -> bool:
    """This process serves the AFD FFN role."""
    cfg = afd_config(vllm_config)
    return cfg is not None and cfg.is_ffn


def is_attention(vllm_config=None) -> bool:
    """This process serves the AFD attention role."""
    cfg = afd_config(vllm_config)
    return cfg is not None and cfg.is_attention


# CUDA graph captures in progress in this process (see graph_capture_guard).
_captures = 0
_captures_lock = threading.Lock()


@contextlib.contextmanager
def graph_capture_guard():
    """Around the model runner's graph captures (the worker calls it): vLLM
    captures in CUDA's global mode, where a synchronising CUDA call of any other
    thread - the cuda_ipc watchdog's probe of the device error word - makes the
    capture fail. The watchdog skips that probe meanwhile (socket checks go on)."""
    global _captures
    with _captures_lock:
        _captures += 1
    try:
        yield
    finally:
        with _captures_lock:
            _captures -= 1


def unless_capturing(fn):
    """``fn()``, or None while a graph capture is in progress; a capture waits
    for a running ``fn`` to return before it starts."""
    with _captures_lock:
        return None if _captures else fn()
