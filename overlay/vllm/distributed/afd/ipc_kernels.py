# SPDX-License-Identifier: Apache-2.0
"""Device kernels of the cuda_ipc connector (Triton): a hand-over between two
processes of one host is a copy into the peer's inbox and a release-store of a
flag that the peer's kernel spins on (acquire), all of it device work, so that
CUDA graphs capture it.

Two ways to run one hand-over:

* split (three launches a hand-over): a torch copy, then ``signal`` bumps the
  sender's device counter and release-stores it into the peer's flag; the
  receiver's ``wait`` spins until its flag reaches its own counter + 1, then a
  torch copy takes the message out of the inbox;
* fused (one launch per side): ``send_fused`` copies the message and the last of
  its programs to finish signals; ``recv_fused`` has every program spin on the
  flag, copy its part of the message, and the last one advance the counter. Each
  saves one dependent kernel launch per side and hand-over, on the path of every
  layer of every step (two hand-overs a layer).

Counters live on the device, so a replayed graph advances them as an eager step
does. Every wait gives up after ``timeout_ns`` (``globaltimer``) and writes the
message number it gave up on into an error word that the hosts watch.
"""

from __future__ import annotations

import torch

try:  # triton ships with torch; a build without it cannot use the connector
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover
    triton = None

# int32 words each program of a fused kernel copies.
FUSED_BLOCK = 2048

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

    @triton.jit(do_not_specialize=["n_words"])
    def _send_fused_kernel(src_ptr, dst_ptr, n_words, ctr_ptr, flag_ptr, done_ptr,
                           BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        tl.debug_barrier()  # this program's stores, before it is counted
        prev = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys")
        if prev == tl.num_programs(0) - 1:  # the last program: every part is written
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
            c = tl.load(ctr_ptr) + 1
            tl.store(ctr_ptr, c)
            tl.atomic_xchg(flag_ptr, c, sem="release", scope="sys")

    @triton.jit(do_not_specialize=["n_words", "timeout_ns"])
    def _recv_fused_kernel(src_ptr, dst_ptr, n_words, ctr_ptr, flag_ptr, err_ptr, done_ptr,
                           timeout_ns, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        c = tl.load(ctr_ptr) + 1  # every program reads it before the last one advances it
        t0 = globaltimer()
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        waiting = v < c
        while waiting:
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            waiting = (v < c) & ((globaltimer() - t0) < timeout_ns)
        if v < c:
            tl.store(err_ptr, c)
        tl.debug_barrier()  # the other threads read after this program's acquire
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        # .cg: from L2, never a line of an earlier message left in this SM's L1
        data = tl.load(src_ptr + offs, mask=mask, cache_modifier=".cg")
        tl.store(dst_ptr + offs, data, mask=mask)
        tl.debug_barrier()
        prev = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if prev == tl.num_programs(0) - 1:
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
            tl.store(ctr_ptr, c)


def available() -> bool:
    return triton is not None


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


def fusable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Both contiguous, same size, a whole number of 4-byte words, 4-byte aligned."""
    n = src.numel() * src.element_size()
    return (
        src.is_contiguous()
        and dst.is_contiguous()
        and n == dst.numel() * dst.element_size()
        and n % 4 == 0
        and src.data_ptr() % 4 == 0
        and dst.data_ptr() % 4 == 0
    )


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


def _grid(n_words: int) -> tuple[int]:
    return (max(1, triton.cdiv(n_words, FUSED_BLOCK)),)


def send_fused(
    src: torch.Tensor, dst: torch.Tensor, ctr: torch.Tensor, flag: torch.Tensor,
    done: torch.Tensor,
) -> None:  # fmt: skip
    """``dst.copy_(src)`` then :func:`signal`, in one launch. ``done``: an int64 word
    of this side's, zero between launches, that the programs count themselves in."""
    require()
    s, d = _words(src), _words(dst)
    _send_fused_kernel[_grid(s.numel())](s, d, s.numel(), ctr, flag, done, BLOCK=FUSED_BLOCK)


def recv_fused(
    src: torch.Tensor, dst: torch.Tensor, ctr: torch.Tensor, flag: torch.Tensor,
    err: torch.Tensor, done: torch.Tensor, timeout_ns: int,
) -> None:  # fmt: skip
    """:func:`wait` then ``dst.copy_(src)``, in one launch (``done`` as for
    :func:`send_fused`)."""
    require()
    s, d = _words(src), _words(dst)
    _recv_fused_kernel[_grid(s.numel())](
        s, d, s.numel(), ctr, flag, err, done, timeout_ns, BLOCK=FUSED_BLOCK
    )
