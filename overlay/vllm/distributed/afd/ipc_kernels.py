# SPDX-License-Identifier: Apache-2.0
"""Device kernels of the cuda_ipc connector (Triton): a hand-over between two
processes of one host is a copy into the peer's inbox, then ``signal`` bumps the
sender's device counter and release-stores it into the peer's flag; the
receiver's ``wait`` spins until its flag reaches its own counter + 1, then a copy
takes the message out. All of it is device work, so CUDA graphs capture it, and
counters live on the device, so a replayed graph advances them as an eager step
does. Every wait gives up after ``timeout_ns`` (``globaltimer``) and writes the
message number it gave up on into an error word that the hosts watch.

One hand-over costs about 5 us on an H200 with both processes on it under MPS
(benchmarks/handover.py, which also measures a fused one-kernel-per-side variant:
slower, 5.3-6.7 us).
"""

from __future__ import annotations

import torch

try:  # triton ships with torch; a build without it cannot use the connector
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _signal_kernel(ctr_ptr, flag_ptr):
        c = tl.load(ctr_ptr) + 1
        tl.store(ctr_ptr, c)
        tl.atomic_xchg(flag_ptr, c, sem="release", scope="sys")

    @triton.jit(do_not_specialize=["num_tokens", "flags", "ub1_tokens"])
    def _control_kernel(ctr_ptr, row_ptr, num_tokens, flags, ub1_tokens):
        c = tl.load(ctr_ptr) + 1
        tl.store(ctr_ptr, c)
        tl.store(row_ptr + 1, c)
        tl.store(row_ptr + 2, num_tokens.to(tl.int64))
        tl.store(row_ptr + 3, flags.to(tl.int64))
        tl.store(row_ptr + 6, ub1_tokens.to(tl.int64))
        tl.atomic_xchg(row_ptr, c, sem="release", scope="sys")

    @triton.jit(do_not_specialize=["timeout_ns"])
    def _wait_kernel(ctr_ptr, flag_ptr, err_ptr, timeout_ns):
        c = tl.load(ctr_ptr) + 1
        t0 = globaltimer()
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        waiting = v < c
        while waiting:
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            waiting = (v < c) & ((globaltimer() - t0) < timeout_ns)
        if v < c:
            tl.store(err_ptr, c)  # the message this wait gave up on
        tl.store(ctr_ptr, c)


def require() -> None:
    if triton is None:
        raise RuntimeError("AFD cuda_ipc connector needs triton")


def signal(ctr: torch.Tensor, flag: torch.Tensor) -> None:
    """Bump ``ctr`` and release-store it into the peer's ``flag``."""
    require()
    _signal_kernel[(1,)](ctr, flag, num_warps=1)


def control(
    ctr: torch.Tensor, row: torch.Tensor, num_tokens: int, flags: int, ub1_tokens: int = 0
) -> None:
    """Write a step-control message into the FFN rank's control ``row`` and publish it."""
    require()
    _control_kernel[(1,)](ctr, row, num_tokens, flags, ub1_tokens, num_warps=1)


def wait(ctr: torch.Tensor, flag: torch.Tensor, err: torch.Tensor, timeout_ns: int) -> None:
    """Spin until ``flag`` reaches ``ctr`` + 1 (or ``timeout_ns``: then ``err``), advance ``ctr``."""
    require()
    _wait_kernel[(1,)](ctr, flag, err, timeout_ns, num_warps=1)
