"""The learner's ranks: one process per rank under torchrun, or one process alone.

    torchrun --nproc-per-node N -m services.learner    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
                                                         MASTER_PORT come from torchrun
    python -m services.learner                         world size 1: no process group unless
                                                         fsdp=on (then a group of one)

Rank 0 leads: it consumes the stream, serves HTTP, pushes weights and acknowledges (worker.py);
the other ranks follow its commands (data_parallel.py). Commands and results travel as pickled
objects over a gloo group (`Ranks.scatter`, `Ranks.gather`); on GPUs the model's own collectives
run on NCCL beside it. `init_ranks` runs once per process, before the model is built; `current()`
is what it made (the Trainer's default, like torch's own default process group).

Guarantees: a rendezvous that does not complete within `timeout_s` raises RendezvousError naming
the world size, the address and this rank; every later collective fails after `timeout_s` too
(so a rank whose peers died or hang never waits forever). Without a process group (world size 1,
FSDP off) every collective here is the identity.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shellrl.process_groups import leave

if TYPE_CHECKING:
    from services.learner.settings import LearnerSettings

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """The ranks did not all join the process group within the timeout."""


@dataclass(frozen=True)
class Ranks:
    """rank, world_size, local_rank: torchrun's; fsdp: the model is sharded with FSDP2 (always
    when world_size > 1); control: the gloo group carrying commands and results (None: no
    process group); timeout_s: how long a collective waits for the other ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    fsdp: bool = False
    control: Any = None
    timeout_s: float = float("inf")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def scatter(self, messages: list | None) -> Any:
        """Rank r receives messages[r]; the leader passes one per rank, the others None. Blocks
        until every rank called it (followers wait for their next command here)."""
        if self.control is None:
            return messages[0]
        out = [None]
        dist.scatter_object_list(out, messages if self.leader else None, src=0, group=self.control)
        return out[0]

    def gather(self, obj: Any) -> list | None:
        """Every rank's `obj`, in rank order, on the leader (None on the others)."""
        if self.control is None:
            return [obj]
        out = [None] * self.world_size if self.leader else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self, *, together: bool = False) -> None:
        """Leave the process group (idempotent): shellrl.process_groups.leave. together: every
        rank is closing at this point (after STOP), so they first meet at a barrier; never
        after an error, when a peer may be inside another collective. A process that had a
        group ends with shellrl.process_groups.exit_process, never the interpreter's own exit."""
        global _current
        if self.control is not None:
            leave(together=together)
        _current = None


_current: Ranks | None = None


def current() -> Ranks:
    """The ranks `init_ranks` made in this process; world size 1 without FSDP when it never ran."""
    return _current or Ranks()


def env_ranks(env=os.environ) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it.
    Raises ValueError for an inconsistent environment."""
    rank, world, local = (
        int(env.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
    )
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return rank, world, local


def _store(rank: int, world: int, timeout: timedelta, env) -> dist.Store:
    """The rendezvous store: torchrun's agent store (or rank 0's own TCPStore when a launcher
    other than torchrun set MASTER_ADDR/MASTER_PORT), under a prefix per torchrun attempt; an
    in-process store at world size 1 without a launcher. The prefix matters: torchrun 2.13 hands
    a restarted group the same agent store, whose keys from the previous attempt name the dead
    ranks' gloo addresses (a restarted group would then never connect)."""
    if "MASTER_ADDR" not in env:
        return dist.HashStore()
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent,
        timeout=timeout,
        multi_tenant=True,
    )
    return dist.PrefixStore(
        f"shellrl-learner/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )


def join_ranks(settings: LearnerSettings) -> Ranks:
    """`init_ranks` with the learner's settings, for start-up (rank 0 and followers alike): a
    rendezvous that fails or a bad fsdp setting exits with a one-line `learner: ...` error."""
    try:
        return init_ranks(
            fsdp=settings.fsdp,
            backend=settings.distributed_backend,
            device=settings.device,
            timeout_s=settings.distributed_timeout_s,
        )
    except (RendezvousError, ValueError) as exc:
        raise SystemExit(f"learner: {exc}") from None


def init_ranks(*, fsdp: str, backend: str, device: str, timeout_s: float, env=os.environ) -> Ranks:
    """Join the process group of this rank (see the module docstring) and remember it (`current`).

    fsdp: "auto" (FSDP2 when the world size is > 1), "on" or "off" (world size 1 only);
    backend: "auto" (nccl on CUDA, else gloo), "gloo" or "nccl"; device: the learner's device
    setting ("auto", "cpu", "cuda"): on CUDA each rank takes GPU LOCAL_RANK. Raises ValueError for
    fsdp "off" with a world size > 1, RendezvousError when the group does not form in time."""
    global _current
    rank, world, local = env_ranks(env)
    if fsdp == "off" and world > 1:
        raise ValueError(
            f"SHELLRL_FSDP=off with WORLD_SIZE={world}: a learner of several ranks shards the "
            "model with FSDP2; set SHELLRL_FSDP=auto"
        )
    sharded = fsdp == "on" or (fsdp == "auto" and world > 1)
    if not sharded:
        _current = Ranks()
        return _current
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local)
    backend = backend if backend != "auto" else ("nccl" if cuda else "gloo")
    timeout = timedelta(seconds=timeout_s)
    where = f"{env.get('MASTER_ADDR', 'in process')}:{env.get('MASTER_PORT', '-')}"
    try:
        dist.init_process_group(
            backend,
            store=_store(rank, world, timeout, env),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    except Exception as exc:  # DistStoreError, DistNetworkError, RuntimeError: all mean "not met"
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(
            f"rendezvous of {world} learner ranks at {where} did not complete within "
            f"{timeout_s:g} s (this is rank {rank}): start every rank (torchrun --nnodes / "
            f"--nproc-per-node) and check that each reaches MASTER_ADDR:MASTER_PORT ({detail})"
        ) from exc
    control = (
        dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    )
    _current = Ranks(rank, world, local, True, control, timeout_s)
    log.info(
        "learner rank joined",
        extra={"rank": rank, "world_size": world, "backend": backend, "address": where},
    )
    return _current
