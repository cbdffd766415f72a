"""The TP control channel: pickled Python objects over a standalone gloo group.

The engine is control rank 0 and broadcasts each step's SchedulerOutput; worker rank r is
control rank r + 1, and worker rank 0 replies point to point with its ModelRunnerOutput, or with
(ERROR, message) when its step failed. STOP ends the workers' loops. The group is apart from
torch.distributed's default (NCCL) group, so control traffic never queues behind collectives.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


class ControlChannel:
    """Pickled Python objects over a standalone gloo group: the engine (control rank 0)
    broadcasts each step's SchedulerOutput, worker rank 0 (control rank 1) replies point to point.

    A message travels in a fixed buffer, [8-byte length | payload]: one collective per message.
    A payload that does not fit (a step admitting many long prompts) follows in a second
    message of its exact size. Gloo fails a pending operation as soon as a peer's connection
    closes (a dead worker), or after the group's timeout (a hung one).
    """

    CAPACITY = 16 * 1024
    ENGINE = 0

    def __init__(self, group) -> None:
        self.group = group
        self.buffer = torch.zeros(self.CAPACITY, dtype=torch.uint8)
        self.view = self.buffer.numpy()

    def _pack(self, obj) -> bytes | None:
        """Write obj into the buffer; return the payload when it must follow separately."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.view[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        if len(payload) > self.CAPACITY - 8:
            return payload
        self.view[8 : 8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        return None

    def _unpack(self, receive_more):
        n = int.from_bytes(self.view[:8].tobytes(), "little")
        if n <= self.CAPACITY - 8:
            return pickle.loads(self.view[8 : 8 + n].tobytes())
        big = torch.empty(n, dtype=torch.uint8)
        receive_more(big)
        return pickle.loads(big.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.ENGINE
        self.group.broadcast([tensor], options).wait()

    def broadcast(self, obj) -> None:
        """Engine side: send obj to every worker."""
        overflow = self._pack(obj)
        self._broadcast(self.buffer)
        if overflow is not None:
            self._broadcast(torch.frombuffer(bytearray(overflow), dtype=torch.uint8))

    def receive_broadcast(self):
        """Worker side: the engine's next message."""
        self._broadcast(self.buffer)
        return self._unpack(self._broadcast)

    def send(self, obj, dst: int) -> None:
        overflow = self._pack(obj)
        self.group.send([self.buffer], dst, 0).wait()
        if overflow is not None:
            self.group.send([torch.frombuffer(bytearray(overflow), dtype=torch.uint8)], dst, 0).wait()

    def receive(self, src: int):
        self.group.recv([self.buffer], src, 0).wait()
        return self._unpack(lambda big: self.group.recv([big], src, 0).wait())


# Control messages: the engine's last broadcast, and the tag of rank 0's failure reply.
STOP = "stop"
ERROR = "error"


def make_control_store(host: str, port: int, size: int, is_engine: bool) -> dist.TCPStore:
    """Rendezvous of the control group, hosted by the engine (port 0: a free port, read back
    from `store.port` and passed to the workers through Ray)."""
    return dist.TCPStore(host, port, size, is_engine, timedelta(seconds=300), wait_for_workers=False)


def make_control_channel(store: dist.TCPStore, rank: int, size: int, timeout_s: float) -> ControlChannel:
    """Join the control group (blocks until all `size` members have joined). It is apart from
    torch.distributed's default group; its timeout bounds every wait (the step timeout)."""
    return ControlChannel(dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s)))
