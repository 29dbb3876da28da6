"""Where a process of a local job is, from its environment: torchrun's variables, or the launcher's.

Free of torch, so that the CLI and the launcher start without importing it (re-exported by
:mod:`recsys.distributed`).
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "launched_by_torchrun", "set_local_rank_env"]


def launched_by_torchrun() -> bool:
    """True when torchrun (torch.distributed.run) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (for self-spawned local workers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def set_local_rank_env(rank: int, world_size: int, port: int) -> None:
    """Describe a rank of a single-machine job in the environment, as torchrun would."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
