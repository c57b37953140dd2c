# SPDX-License-Identifier: Apache-2.0
"""NCCL connector for AFD on GPUs (``nccl``, alias ``P2pNcclAFDConnector``).

Handshake, step control and heartbeats travel over the TCP connector's
socket; activations travel by NCCL point-to-point (vLLM's PyNccl) on the
current CUDA stream, so a layer exchange needs no host synchronisation.

Group layout for FFN rank ``f`` serving attention ranks ``f*k .. f*k+k-1``:
one NCCL communicator of ``k + 1`` members, FFN rank = member 0, attention
rank ``a`` = member ``1 + a % k``. Its rendezvous store listens on the FFN
rank's host at the port after its own.

Limits of this release: a pending NCCL receive cannot be cancelled, so a peer
that dies in the middle of a layer exchange is detected through the TCP
control socket only at the next step; an FFN rank serves one attention
session: once all its attention ranks have joined, a rank that joins again
is refused in the handshake reply (restart both sides to re-join).
"""

from __future__ import annotations

import torch

from vllm.afd.protocol import AFDPeerError
from vllm.distributed.afd.base import ConnectorContext, StepPeer, register_connector
from vllm.distributed.afd.tcp import TCPAttentionConnector, TCPFFNConnector
from vllm.logger import init_logger

logger = init_logger(__name__)


def _store_address(ctx: ConnectorContext, ffn_rank: int, member: int) -> tuple[str, int]:
    """Where the rendezvous store of FFN rank ``ffn_rank``'s group listens (member 0, the
    FFN rank, binds it on its interface) and is reached: the port after the FFN rank's
    (nccl serves one FFN rank)."""
    cfg = ctx.config
    host, port = cfg.ffn_listen_address(ffn_rank) if member == 0 else cfg.ffn_address(ffn_rank)
    return host, port + 1


def _create_comm(ctx: ConnectorContext, ffn_rank: int, member: int):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    cfg = ctx.config
    host, port = _store_address(ctx, ffn_rank, member)
    group = StatelessProcessGroup.create(
        host=host,
        port=port,
        rank=member,
        world_size=cfg.attention_ranks_per_ffn + 1,
        store_timeout=int(max(cfg.timeout_s, 30)),
    )
    comm = PyNcclCommunicator(group, device=ctx.device)
    if comm.disabled:
        raise RuntimeError("AFD nccl connector: PyNccl is disabled on this device")
    return comm


class NCCLAttentionConnector(TCPAttentionConnector):
    # The layer data goes over PyNccl, not the TCP socket that recv_start reads.
    dbo_capable = False
    # An NCCL group is formed once per FFN rank session: a lost FFN rank ends the engine.
    can_rejoin = False

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.member = 1 + ctx.rank % ctx.config.attention_ranks_per_ffn
        self.comm = None

    def connect(self) -> None:
        super().connect()
        self.comm = _create_comm(self.ctx, self.ffn_rank, self.member)
        logger.info("AFD: NCCL link to %s up (member %d)", self.peer, self.member)

    def send(self, x: torch.Tensor) -> None:
        self._check()
        self.comm.send(x, dst=0)

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        self._check()
        self.comm.recv(out, src=0)
        return out


class NCCLFFNConnector(TCPFFNConnector):
    dbo_capable = False
    # Layer data moves by device (cuda_ipc) or NCCL: receives queue device work one
    # rank after another, as before; only the TCP control channel is pumped.
    async_io = False
    # The NCCL group cannot be formed again with a restarted attention rank (see
    # _admit), and a receive from a dead member cannot be cancelled: a lost
    # attention rank ends the FFN rank, as before.
    survives_peer_loss = False

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.comm = None
        self._k = ctx.config.attention_ranks_per_ffn

    def _admit(self, rank: int, sock, addr: str, proof: dict) -> bool:
        """Once every attention rank of this FFN rank has joined, the NCCL group
        is formed (or about to be) with those processes: a rank that joins
        again (after a goodbye, a restart of its server) or late cannot become
        a member - its NCCL setup would wait forever for a group that is gone,
        and the FFN rank's receives from it would hang the others. Refused in
        the handshake reply, naming why, so that its attention server fails at
        start; the ranks already served go on."""
        with self._lock:
            formed = self._ever_complete or self.comm is not None
        if formed:
            return self._refuse_hello(sock, addr, (
                f"FFN rank {self.ctx.rank} (nccl) formed its NCCL group with attention "
                f"ranks {sorted(self.expected)} already and cannot take attention rank "
                f"{rank} again: an nccl FFN rank serves one session; restart the FFN "
                "server, then the attention servers"
            ), proof)  # fmt: skip
        return super()._admit(rank, sock, addr, proof)

    def wait_step(self, timeout: float) -> list[StepPeer]:
        if self.comm is None and self._ever_complete:
            self.comm = _create_comm(self.ctx, self.ctx.rank, 0)
            logger.info("AFD: NCCL group of FFN rank %d up", self.ctx.rank)
        had_peers = bool(self.peers)
        ready = super().wait_step(timeout)
        if self.comm is not None and had_peers and not self.peers:
            raise AFDPeerError(
                "all AFD attention ranks left; an NCCL FFN rank serves one session: "
                "restart the FFN server before restarting attention"
            )
        return ready

    def recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        self._peer(peer)
        self.comm.recv(out, src=1 + peer.rank % self._k)

    def send(self, peer: StepPeer, y: torch.Tensor) -> None:
        self._peer(peer)
        self.comm.send(y.contiguous(), dst=1 + peer.rank % self._k)


register_connector("nccl", NCCLAttentionConnector, NCCLFFNConnector)
