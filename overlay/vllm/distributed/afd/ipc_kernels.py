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

The ``*_via`` variants (cuda_ipc rejoin, ``connector_extra_config.ipc_rejoin``)
take the peer's addresses from a device-side pointer table of this side's
instead of from their arguments: a captured graph then holds only the table's
address, and a re-handshake with a restarted peer rewrites the table (not the
graph). Entry ``TABLE_CTRL`` is the peer's control buffer (its control row,
then its data flags), entry ``TABLE_INBOX`` the peer's inbox. A direct kernel and
its ``_via`` one share one device body (``signal_at``, ``_control_at``) that takes
the resolved address; only where the address comes from differs.
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
    def signal_at(ctr_ptr, flag_ptr):
        """Device part of ``signal`` (inlined into its kernels): bump the counter at
        ``ctr_ptr`` and release-store it into the flag at ``flag_ptr``, already resolved."""
        c = tl.load(ctr_ptr) + 1
        tl.store(ctr_ptr, c)
        tl.atomic_xchg(flag_ptr, c, sem="release", scope="sys")

    @triton.jit
    def _control_at(ctr_ptr, row_ptr, num_tokens, flags, ub1_tokens):
        """Device part of ``control``: the row's words, then its flag (word 0) last."""
        c = tl.load(ctr_ptr) + 1
        tl.store(ctr_ptr, c)
        tl.store(row_ptr + 1, c)
        tl.store(row_ptr + 2, num_tokens.to(tl.int64))
        tl.store(row_ptr + 3, flags.to(tl.int64))
        tl.store(row_ptr + 6, ub1_tokens.to(tl.int64))
        tl.atomic_xchg(row_ptr, c, sem="release", scope="sys")

    @triton.jit
    def spin_wait(flag_ptr, c, err_ptr, timeout_ns):
        """Device part of ``wait``: spin until the flag at ``flag_ptr`` reaches message
        ``c`` or ``timeout_ns`` pass; on a timeout write ``c`` into ``err_ptr``. The
        caller advances its counter."""
        t0 = globaltimer()
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        waiting = v < c
        while waiting:
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            waiting = (v < c) & ((globaltimer() - t0) < timeout_ns)
        if v < c:
            tl.store(err_ptr, c)  # the message this wait gave up on

    @triton.jit
    def _signal_kernel(ctr_ptr, flag_ptr):
        signal_at(ctr_ptr, flag_ptr)

    @triton.jit(do_not_specialize=["num_tokens", "flags", "ub1_tokens"])
    def _control_kernel(ctr_ptr, row_ptr, num_tokens, flags, ub1_tokens):
        _control_at(ctr_ptr, row_ptr, num_tokens, flags, ub1_tokens)

    @triton.jit(do_not_specialize=["timeout_ns"])
    def _wait_kernel(ctr_ptr, flag_ptr, err_ptr, timeout_ns):
        c = tl.load(ctr_ptr) + 1
        spin_wait(flag_ptr, c, err_ptr, timeout_ns)
        tl.store(ctr_ptr, c)


TABLE_CTRL, TABLE_INBOX = 0, 1
COPY_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _peer_ptr(table_ptr, entry, like_ptr):
        """Entry ``entry`` of the pointer table as a pointer of ``like_ptr``'s type."""
        return tl.load(table_ptr + entry).to(like_ptr.dtype, bitcast=True)

    @triton.jit
    def _signal_via_kernel(ctr_ptr, table_ptr, word):
        signal_at(ctr_ptr, _peer_ptr(table_ptr, 0, ctr_ptr) + word)

    @triton.jit(do_not_specialize=["num_tokens", "flags", "ub1_tokens"])
    def _control_via_kernel(ctr_ptr, table_ptr, num_tokens, flags, ub1_tokens):
        _control_at(ctr_ptr, _peer_ptr(table_ptr, 0, ctr_ptr), num_tokens, flags, ub1_tokens)

    @triton.jit
    def _copy_via_kernel(src_ptr, table_ptr, offset, n, BLOCK: tl.constexpr):
        """``n`` elements of ``src`` to the peer's inbox at element ``offset``."""
        dst_ptr = _peer_ptr(table_ptr, 1, src_ptr) + offset
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=mask), mask=mask)


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


def signal_via(ctr: torch.Tensor, table: torch.Tensor, word: int) -> None:
    """``signal`` into word ``word`` of the peer's control buffer (pointer table entry
    ``TABLE_CTRL``)."""
    require()
    _signal_via_kernel[(1,)](ctr, table, word, num_warps=1)


def control_via(
    ctr: torch.Tensor, table: torch.Tensor, num_tokens: int, flags: int, ub1_tokens: int = 0
) -> None:
    """``control`` into the peer's control row (pointer table entry ``TABLE_CTRL``)."""
    require()
    _control_via_kernel[(1,)](ctr, table, num_tokens, flags, ub1_tokens, num_warps=1)


def copy_via(src: torch.Tensor, table: torch.Tensor, offset_bytes: int) -> None:
    """Copy the contiguous ``src`` to byte ``offset_bytes`` of the peer's inbox
    (pointer table entry ``TABLE_INBOX``); the offset is a multiple of the
    element size (the connector aligns messages to 256 bytes)."""
    require()
    size = src.element_size()
    if not src.is_contiguous() or offset_bytes % size:
        raise ValueError(
            f"AFD cuda_ipc: copy_via needs a contiguous source at an offset that is a "
            f"multiple of its element size ({size}); got offset {offset_bytes}"
        )
    n = src.numel()
    grid = (max(1, triton.cdiv(n, COPY_BLOCK)),)
    _copy_via_kernel[grid](src, table, offset_bytes // size, n, BLOCK=COPY_BLOCK)
