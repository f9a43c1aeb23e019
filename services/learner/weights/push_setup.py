"""What a push must know about its engines before it sends anything, learned from their
/server_info on first contact: the transport each can take (cuda_ipc only for engines on a GPU,
else shm), the dtype the buckets travel in (weight_dtype.py; an engine serving weights the
learner cannot produce is refused: `_servable`), whether each is paused around its update
(`pause_for`; `in_place` refused where SGLang's radix cache is on), and its TP size.
`PushSetup` is the part of `WeightSync` (weight_sync.py) that asks; it reads the attributes
WeightSync sets up (client, engines, staging, transport, groups, deadline_s, pause_mode, ...).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.learner.weights import weight_dtype
from services.learner.weights.engine_groups import EngineGroups
from services.learner.weights.engine_rotation import bounded, take_out_of_rotation
from services.learner.weights.weight_transport import WeightStaging, engine_transport

if TYPE_CHECKING:
    import torch

log = logging.getLogger("services.learner.weights.weight_sync")


PAUSE_MODES = ("auto", "off", "retract", "in_place")


class PauseModeRefused(ValueError):
    """A pause mode an engine cannot honour (the learner stops, naming the setting)."""


def pause_for(pause_mode: str, buckets: int, commits_atomically: bool = False) -> str:
    """The pause of one engine's push of `buckets` update calls; "auto":
    * shellrl's engine (`commits_atomically`: it swaps a session's buckets in at once): in_place.
      Unpaused, it commits only once no request is running and admits none meanwhile, so the push
      waited for the longest generation in flight (the main job on CPU: `load` 1,690 ms of a
      1,932 ms push; benchmarks/bench_push_under_load.py); paused in place it commits at once and
      its requests go on, their later tokens labelled with the new version. Not retract: that
      re-prefills every running request at each push (on CPU, a large share of the engine's time).
    * SGLang: retract for more than one bucket (no sampling on a mix of versions), else off.
    The other modes as they are."""
    if pause_mode != "auto":
        return pause_mode
    if commits_atomically:
        return "in_place"
    return "retract" if buckets > 1 else "off"


def radix_cache_refusal(infos: dict[str, dict]) -> str | None:
    """Why `in_place` cannot work with these engines (their /server_info), or None: SGLang (any
    engine but shellrl's, whose version starts "shellrl-engine") refuses the flush of a radix cache
    while a batch is paused in place (scheduler_components/weight_updater.py 120-133), so the
    push's last bucket would fail after loading. shellrl's engine drops its prefix cache at the
    commit, paused or not."""
    blocked = [
        url
        for url, info in infos.items()
        if not str(info.get("version", "")).startswith("shellrl-engine")
        and not info.get("disable_radix_cache", False)
    ]
    if not blocked:
        return None
    return (
        "SHELLRL_WEIGHT_SYNC_PAUSE=in_place: SGLang cannot flush its radix cache while requests "
        f"are paused in place ({', '.join(blocked)} run with the radix cache on); use retract "
        "(or auto), or start SGLang with --disable-radix-cache"
    )


class PushSetup:
    """The first-contact questions of a push, asked for `WeightSync` (module docstring)."""

    async def aclose(self) -> None:
        """`close`, after every engine destroyed its weight-update group (the distributed
        transport: EngineGroups.aclose, bounded), so none stays open once the learner left."""
        if self.groups is not None:
            await self.groups.aclose()
        self.close()

    async def _abandon_sessions(self, opening: dict[str, asyncio.Future]) -> None:
        """Close the sessions opened for a push whose weights were never sent (bounded, errors
        ignored: `reconcile` also closes a stale session before an engine's next full update)."""
        for url, begin in opening.items():
            await bounded(begin, min(self.deadline_s, 5.0))
            await self._end_stale_sessions([url])

    async def end_stale_sessions(self) -> None:
        """End the weight-update session any engine in rotation still has open. For a learner
        restarted from its checkpoint (`LearnerWorker.resume`): only the learner holding the
        run's lock pushes, so a session open now was left by its killed predecessor mid-push,
        and the engine would refuse every push of this process ("a weight-update session is
        already open") until it left rotation and came back through `reconcile` (a chaos run:
        versions 9 and 10 unpublished for 16 s, the gateway's admission stalled meanwhile)."""
        await self._end_stale_sessions([u for u, e in self.engines.items() if e.in_rotation])

    async def _end_stale_sessions(self, urls: list[str]) -> None:
        """End whatever weight-update session each engine has open (a push interrupted mid-way,
        this learner's or a killed one's), bounded, errors ignored (none open: a 400). shellrl's
        engine (`commits_atomically`; unknown: its /server_info read first) discards what the
        session staged, so half a push never goes live; SGLang's end only closes the session."""
        unknown = [u for u in urls if self.engines[u].commits_atomically is None]
        await asyncio.gather(
            *(bounded(self._read_server_info(u), min(self.deadline_s, 5.0)) for u in unknown)
        )
        await asyncio.gather(
            *(
                bounded(
                    self.client.end_weight_update(
                        urls=[u], discard=bool(self.engines[u].commits_atomically)
                    ),
                    min(self.deadline_s, 5.0),
                )
                for u in urls
            )
        )

    async def _resolve(self, model: torch.nn.Module, targets: list[str]) -> None:
        """On the first push: cuda_ipc stays only if every engine can take it (`engine_transport`,
        from /server_info), else shm; the distributed transport's groups get their backend."""
        if self.transport == "distributed" and self.groups is None:
            backend = (
                self.backend
                if self.backend != "auto"
                else ("nccl" if next(model.parameters()).device.type == "cuda" else "gloo")
            )
            self.groups = EngineGroups(
                self.client,
                backend=backend,
                timeout_s=self.deadline_s,
                master_address=self.master_address,
            )
        if self.pause_mode == "in_place" and targets and not self._in_place_checked:
            infos = await bounded(
                self.client.get_server_info(urls=targets), min(self.deadline_s, 5.0)
            )
            if infos is not None:
                self._in_place_checked = True
                refusal = radix_cache_refusal(infos)
                if refusal is not None:
                    raise PauseModeRefused(refusal)
        if self._resolved or not targets:
            return
        infos = await bounded(self.client.get_server_info(urls=targets), min(self.deadline_s, 5.0))
        if infos is None:
            return  # asked again at the next push
        self._resolved = True
        chosen = {engine_transport(self.transport, info) for info in infos.values()}
        if chosen != {self.transport}:
            log.warning(
                "an engine is not on a GPU and cannot take cuda_ipc; using shm (SGLang's envelope)",
                extra={"engines": {u: info.get("version") for u, info in infos.items()}},
            )
            self.staging.close()
            self.transport, self.staging = "shm", WeightStaging("shm", **self._staging_args)

    async def _tp_size(self, url: str) -> int:
        state = self.engines[url]
        if state.tp_size is None:
            await self._read_server_info(url)
        return state.tp_size

    async def _read_server_info(self, url: str) -> None:
        state = self.engines[url]
        info = (await self.client.get_server_info(urls=[url]))[url]
        state.tp_size = int(info.get("tp_size") or 1)
        state.commits_atomically = str(info.get("version", "")).startswith("shellrl-engine")
        state.dtype = weight_dtype.engine_dtype(info, self.checkpoint_dtype)
        state.refused = weight_dtype.refusal(url, info)
        state.info_read = True

    async def _servable(self, targets: list[str]) -> list[str]:
        """The targets the learner can push to. Each engine's /server_info is read first (those
        not met yet, bounded; no answer: not refused this time). An engine that serves weights the
        learner cannot produce (`weight_dtype.refusal`) is refused with one error line (again only
        when its reason changes): at the learner's first push (the engines it starts with) the
        push raises DtypeRefused, so the learner stops; met later (a registered engine joining, a
        seed engine coming back) it is kept out of rotation, `refused` in the sync hash, and its
        /server_info read again at each of reconcile's probes until it serves a dtype the learner
        can produce."""
        unread = [u for u in targets if not self.engines[u].info_read]
        await asyncio.gather(
            *(bounded(self._read_server_info(u), min(self.deadline_s, 5.0)) for u in unread)
        )
        refused = {u: self.engines[u].refused for u in targets if self.engines[u].refused}
        for url, reason in refused.items():
            if self._refusals_logged.get(url) != reason:
                self._refusals_logged[url] = reason
                log.error(reason, extra={"engine": url})
            if self.last_result is not None:
                take_out_of_rotation(self.engines[url], reason)
                self.client.set_available(url, False)
        if refused and self.last_result is None:
            raise weight_dtype.DtypeRefused("; ".join(refused.values()))
        return [u for u in targets if u not in refused]

    async def _resolve_dtype(self, targets: list[str], model: torch.nn.Module) -> None:
        """The dtype of this push (`weight_dtype.push_dtype`) into `staging.dtype`, from the
        engines' /server_info (read for those not met yet, bounded; no answer: unknown, so float32
        this push). Logged when it changes."""
        if not self.staging.casts(model) or self.dtype_setting == "float32":
            chosen, why = "float32", "the learner's dtype"
        else:
            unknown = [u for u in targets if not self.engines[u].info_read]
            await asyncio.gather(
                *(bounded(self._read_server_info(u), min(self.deadline_s, 5.0)) for u in unknown)
            )
            chosen, why = weight_dtype.push_dtype(
                self.dtype_setting, {u: self.engines[u].dtype for u in targets}
            )
        if chosen != self.push_dtype:
            refused = self.dtype_setting in weight_dtype.SIXTEEN_BIT and chosen == "float32"
            (log.warning if refused else log.info)(
                "weight pushes travel in this dtype",
                extra={"dtype": chosen, "reason": why, "setting": self.dtype_setting},
            )
            self.push_dtype = chosen
        self.staging.dtype = weight_dtype.as_torch(chosen)

    async def _pauses(self, targets: list[str], buckets: int) -> dict[str, str]:
        """Each target's pause for a push of `buckets` calls (`pause_for`); "auto" asks an engine
        it has not met its /server_info (bounded; no answer: treated as SGLang)."""
        if self.pause_mode == "auto":
            unknown = [u for u in targets if self.engines[u].commits_atomically is None]
            await asyncio.gather(
                *(bounded(self._read_server_info(u), min(self.deadline_s, 5.0)) for u in unknown)
            )
        return {
            u: pause_for(self.pause_mode, buckets, bool(self.engines[u].commits_atomically))
            for u in targets
        }
