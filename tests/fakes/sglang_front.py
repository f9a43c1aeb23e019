"""The HTTP server and tokenizer manager of an SGLang 0.5.23 engine, in front of real TP ranks
running SGLang's own scheduler-side weight-update code (tests/helpers/sglang_tp_rank.py).

Replaces sglang/srt/entrypoints/http_server.py and the tokenizer manager's control mixin, whose
modules need the GPU stack, for an httpx MockTransport under the learner's EngineClient. What it
keeps of them (tokenizer_control_mixin.py, 0.5.23):
* every request is fanned out to every TP rank at once and the answers merged (success only if
  every rank succeeded), as `FanOutCommunicator`; a failed update is a 400 with SGLang's body;
* pause_generation(retract | in_place) sets `is_pause`; while paused, weight updates run at once;
  without a pause, each update takes the writer lock, which waits for every generation in flight
  (`/generate` holds the reader lock for its whole life): here the ranks' running generations are
  finished first and counted in `waited_for`;
* the label /model_info reports (`weight_version`) moves only when a labelled update succeeded
  (`_update_weight_version_if_provided`);
* /server_info says version 0.5.23, tp_size, dtype bfloat16 and `disable_radix_cache`.
`log` records every request: (path, body without tensor payloads, each rank's reply).
"""

from __future__ import annotations

import asyncio
import json

import httpx

UPDATES = ("/update_weights_from_tensor", "/update_weights_from_distributed")
FANNED_OUT = (
    "/pause_generation",
    "/continue_generation",
    "/begin_weight_update",
    "/end_weight_update",
    *UPDATES,
    "/init_weights_update_group",
    "/destroy_weights_update_group",
)


class SGLangFront:
    def __init__(self, ranks, *, disable_radix_cache: bool = False) -> None:
        """ranks: one multiprocessing Connection per TP rank, in rank order."""
        self.ranks, self.disable_radix_cache = ranks, disable_radix_cache
        self.is_pause = False
        self.weight_version = "default"
        self.waited_for = 0
        # off: admit a generation between two bucket calls (SGLang releases its writer lock
        # between them); `admitted`: (tensors loaded, the scheduler's version label) at that time
        self.admit_between_buckets = False
        self.admitted: list[tuple[int, str]] = []
        self.log: list[tuple[str, dict | None, list]] = []

    async def ask(self, op: str, body=None) -> list:
        """Every rank's reply to (op, body), asked at once (ranks meet in barriers)."""

        def one(conn):
            conn.send((op, body))
            status, reply = conn.recv()
            if status != "ok":
                raise RuntimeError(f"rank failed {op}: {reply}")
            return reply

        return list(await asyncio.gather(*(asyncio.to_thread(one, c) for c in self.ranks)))

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        if path == "/server_info":
            return httpx.Response(
                200,
                json={
                    "version": "0.5.23",
                    "tp_size": len(self.ranks),
                    "dtype": "bfloat16",
                    "disable_radix_cache": self.disable_radix_cache,
                },
            )
        if path == "/model_info":
            return httpx.Response(200, json={"weight_version": self.weight_version})
        if path == "/flush_cache":
            replies = await self.ask("flush_cache")
            ok = all(r["success"] for r in replies)
            return httpx.Response(200 if ok else 400, text="Cache flushed.\n" if ok else "busy\n")
        if path not in FANNED_OUT:
            return httpx.Response(404, json={"detail": "Not Found"})
        op = path.strip("/")
        if path in UPDATES + ("/begin_weight_update", "/end_weight_update") and not self.is_pause:
            # the writer lock: every generation in flight ends first
            self.waited_for += sum(r["finished"] for r in await self.ask("finish_running"))
        replies = await self.ask(op, body)
        shown = {k: v for k, v in (body or {}).items() if k != "serialized_named_tensors"}
        self.log.append((path, shown, replies))
        if path == "/pause_generation":
            self.is_pause = True
            return httpx.Response(200, json={"message": "Generation paused", "status": "ok"})
        if path == "/continue_generation":
            self.is_pause = False
            return httpx.Response(200, json={"message": "Generation continued", "status": "ok"})
        success = all(r.get("success", True) for r in replies)
        message = "; ".join(r.get("message", "") for r in replies if not r.get("success", True))
        if success and path in UPDATES and body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        if (
            self.admit_between_buckets
            and success
            and path in UPDATES
            and not self.is_pause
            and body.get("weight_version") is None
        ):
            for reply in await self.ask("admit"):
                self.admitted.append((reply["loaded"], reply["weight_version"]))
        content = {"success": success, "message": message or "Success."}
        if path in UPDATES:
            content["num_paused_requests"] = 0
        return httpx.Response(200 if success else 400, json=content)

    def updates(self) -> list[tuple[dict, list]]:
        """(body, replies) of every weight update call, in order."""
        return [(body, replies) for path, body, replies in self.log if path in UPDATES]
