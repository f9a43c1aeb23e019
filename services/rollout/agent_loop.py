"""One episode of one task: sandbox session, prompt, generate / parse / exec turns, a Trajectory.

Consumes an `EpisodeSpec` (task, ids, sampling); produces a `Trajectory` that satisfies the iron
laws of DESIGN.md section 4:
* Token-in, token-out: `prompt_ids` are the exact ids of the first request; every request sends
  prompt + all segments so far; ACTION ids and log-probs are stored exactly as the engine returned
  them; an observation is tokenized once, on its own, and appended. History is never re-tokenized.
* ACTION segments have loss mask 1 and the engine's `weight_version`; OBSERVATION segments (tool
  output plus the template tokens that close and open turns) mask 0. Special tokens come only
  from the chat template: special-token text in a command's output or the instruction is
  tokenized as plain text (`ChatFormat`). Setup output never reaches the prompt (a failed
  setup is an INFRA_SANDBOX failure_detail).
* Partial rollout: a request aborted by a weight update keeps its tokens as an ACTION segment of
  the old version; the same turn continues with a new request (prompt + everything so far) and
  the remaining token budget, so no token is lost or duplicated.
* One engine per episode (`engine_pin.EnginePin`): every request of an episode goes to the engine
  of its first one (prefix cache hits); when that engine fails or leaves, the episode continues
  on another engine from its exact token prefix, at most `max_engine_failovers` times.
* Failures are data: engine unreachable, erroring or answering out of contract (e.g. a NaN
  log-prob: `parse_generate_response`) -> FAILURE_INFRA_ENGINE, sandbox ->
  FAILURE_INFRA_SANDBOX, episode wall-clock budget -> FAILURE_TIMEOUT_BUDGET, a bug in this
  process -> FAILURE_INFRA_ROLLOUT; never a reward of 0 in disguise. The episode ends on an answer,
  `max_turns`, the context budget (`truncated`), or a failure.

The command of the last turn still runs (it may change the workspace the verifier checks), but
no observation tokens follow it: its tool event rides on a zero-token OBSERVATION segment, so
`prompt_ids + concat(segments)` equals the last request's input ids plus its output ids.

Sandbox sessions: a training episode that ends without failure keeps its session for the
verifier (`sandbox_session_id`), which releases it after the checks; a failed episode's session
is deleted here and the field left empty. Session creation waits while the sandbox answers 429.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from services.rollout import metrics as m
from services.rollout.actions import AnswerAction, BashAction, parse_action
from services.rollout.engine_pin import EnginePin
from services.rollout.episode_spec import EpisodeLimits, EpisodeSpec
from services.rollout.prompt import ChatFormat, render_parse_error, render_tool_response
from services.rollout.seeding import request_seed
from shellrl.clients.engine_responses import EngineError, EngineUnavailable, GenerateResult
from shellrl.clients.sandbox import SandboxBadRequest, SandboxError, SandboxSetupFailed
from shellrl.contract import (
    EpisodeEnd,
    Failure,
    FinishReason,
    SamplingParams,
    Task,
    ToolEvent,
    Trajectory,
    action_segment,
    encode_token_ids,
    failure_label,
    min_policy_version,
    observation_segment,
    split_name,
)
from shellrl.service.logging import log_context

log = logging.getLogger(__name__)

HARNESS = "shellrl-rollout/2"  # 2: special-token text in contents is plain text (issue 15)
STOP_STRINGS = ("</bash>", "</answer>")
SETUP_FAILED = (
    "task setup failed"  # failure_detail prefix: the task's own setup script failed (not retried)
)
_FINISH = {
    "stop": FinishReason.FINISH_REASON_STOP,
    "length": FinishReason.FINISH_REASON_LENGTH,
    "abort": FinishReason.FINISH_REASON_ABORT,
}


class EpisodeFailed(Exception):
    def __init__(self, failure: int, detail: str) -> None:
        super().__init__(detail)
        self.failure, self.detail = failure, detail


class AgentLoop:
    """Runs episodes; one instance serves hundreds of concurrent `run` calls."""

    def __init__(self, engine, sandbox, chat: ChatFormat, limits: EpisodeLimits) -> None:
        self.engine, self.sandbox, self.chat, self.limits = engine, sandbox, chat, limits
        digest = hashlib.sha256(
            repr(
                (
                    chat.system_prompt,
                    chat.examples,
                    chat.observation_role,
                    chat.close_and_open,
                    chat.after_observation,
                )
            ).encode()
        ).hexdigest()[:10]
        self.harness_version = f"{HARNESS}+{digest}"
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, instruction: str) -> list[int]:
        ids = self._prompt_cache.get(instruction)
        if ids is None:
            ids = self.chat.prompt_ids(instruction)
            if len(self._prompt_cache) > 4096:
                self._prompt_cache.clear()
            self._prompt_cache[instruction] = ids
        return ids

    async def run(self, spec: EpisodeSpec) -> Trajectory:
        """Run one episode to its end. Never raises for episode failures (they are data);
        CancelledError propagates after the session is deleted."""
        task = spec.task
        traj = Trajectory(
            trajectory_id=spec.trajectory_id,
            task_id=task.task_id,
            group_id=spec.group_id,
            attempt=spec.attempt,
            group_size=spec.group_size,
            harness_version=self.harness_version,
            split=split_name(task.split),
            source=task.source,
            eval=spec.eval,
            evaluation_id=spec.evaluation_id,
            created_at=time.time(),
            admitted_at=spec.admitted_at,
        )
        traj.task.CopyFrom(task)
        session_id = ""
        with log_context(
            trajectory_id=spec.trajectory_id, group_id=spec.group_id, task_id=task.task_id
        ):
            try:
                session_id = await self._create_session(task, traj)
                traj.sandbox_session_id = session_id
                timeout = asyncio.timeout(self.limits.episode_timeout_s)
                try:
                    async with timeout:
                        await self._turns(spec, traj, session_id)
                except TimeoutError:
                    if not timeout.expired():
                        raise
                    raise EpisodeFailed(
                        Failure.FAILURE_TIMEOUT_BUDGET,
                        f"episode budget of {self.limits.episode_timeout_s:g} s ran out",
                    ) from None
            except EpisodeFailed as exc:
                _fail(traj, exc.failure, exc.detail)
            except (EngineUnavailable, EngineError) as exc:
                _fail(traj, Failure.FAILURE_INFRA_ENGINE, f"engine: {exc}")
            except SandboxSetupFailed as exc:
                output = (exc.result.stderr or exc.result.stdout)[-500:]
                _fail(
                    traj,
                    Failure.FAILURE_INFRA_SANDBOX,
                    f"{SETUP_FAILED}: {exc}; output: {output!r}",
                )
            except SandboxError as exc:
                _fail(traj, Failure.FAILURE_INFRA_SANDBOX, f"sandbox: {exc}")
            except asyncio.CancelledError:
                await self._delete_session(session_id)
                raise
            except Exception as exc:  # a bug here: say so, never a task outcome
                log.exception("episode crashed in the gateway")
                _fail(traj, Failure.FAILURE_INFRA_ROLLOUT, f"rollout: {type(exc).__name__}: {exc}")
            traj.finished_at = time.time()
            if traj.failure != Failure.FAILURE_NONE or not spec.keep_session:
                await self._delete_session(session_id)
                if traj.failure != Failure.FAILURE_NONE:
                    traj.sandbox_session_id = ""
            _count(traj)
        return traj

    # --- turns ---------------------------------------------------------------------------------

    async def _turns(self, spec: EpisodeSpec, traj: Trajectory, session_id: str) -> None:
        prompt = self.prompt_ids(spec.task.instruction)
        traj.prompt_ids = encode_token_ids(prompt)
        m.PROMPT_TOKENS.inc(len(prompt))
        input_ids = list(prompt)
        max_turns = spec.task.max_turns or self.limits.max_turns
        pin = EnginePin(
            self.engine,
            pinned=self.limits.pin_engine,
            max_failovers=self.limits.max_engine_failovers,
        )
        for turn in range(max_turns):
            room = self.limits.max_context_tokens - len(input_ids)
            if room <= 0:
                _end(traj, EpisodeEnd.EPISODE_END_CONTEXT, truncated=True)
                return
            max_new = min(spec.sampling.max_new_tokens, room)
            action_ids, finish = await self._generate_turn(
                spec, traj, pin, input_ids, turn, max_new
            )
            input_ids += action_ids
            traj.num_turns = turn + 1
            m.TURNS.inc()
            if finish == "length" and max_new < spec.sampling.max_new_tokens:
                _end(traj, EpisodeEnd.EPISODE_END_CONTEXT, truncated=True)
                return
            action = parse_action(self.chat.decode(action_ids), self.chat.end_of_turn)
            if isinstance(action, AnswerAction):
                traj.answer = action.answer
                _end(traj, EpisodeEnd.EPISODE_END_ANSWER, terminated=True)
                return
            if isinstance(action, BashAction):
                body, event = await self._exec(traj, session_id, action.command)
            else:
                m.PARSE_ERRORS.labels(action.kind).inc()
                body, event = (
                    render_parse_error(action.message),
                    ToolEvent(exit_code=-1, parse_error=action.message),
                )
            last = turn == max_turns - 1
            obs = [] if last else self.chat.observation_ids(body, action_ids)
            overflow = len(input_ids) + len(obs) >= self.limits.max_context_tokens
            if overflow:
                obs = []
            traj.segments.append(observation_segment(obs, tool_event=event, turn=turn))
            m.OBSERVATION_TOKENS.inc(len(obs))
            input_ids += obs
            if overflow and not last:
                _end(traj, EpisodeEnd.EPISODE_END_CONTEXT, truncated=True)
                return
        _end(traj, EpisodeEnd.EPISODE_END_MAX_TURNS)

    async def _generate_turn(
        self,
        spec: EpisodeSpec,
        traj: Trajectory,
        pin: EnginePin,
        input_ids: list[int],
        turn: int,
        max_new: int,
    ) -> tuple[list[int], str]:
        """One model reply, continued across aborts. Returns (all ids of the turn, last finish reason)."""
        turn_ids: list[int] = []
        sampling = spec.sampling.to_proto()
        for k in range(self.limits.max_continuations + 1):
            params = {
                "temperature": spec.sampling.temperature,
                "top_p": spec.sampling.top_p,
                "top_k": spec.sampling.top_k,
                "max_new_tokens": max_new - len(turn_ids),
                "stop": list(STOP_STRINGS),
                "stop_token_ids": [self.chat.end_of_turn_id],
                "no_stop_trim": True,
                "skip_special_tokens": False,
            }
            if spec.seed is not None:
                params["sampling_seed"] = request_seed(spec.seed, turn, k)
            rid = f"{spec.trajectory_id}-t{turn}-r{k}"
            start = time.monotonic()
            result, rid = await pin.generate(input_ids + turn_ids, params, rid)
            m.GENERATE_SECONDS.observe(time.monotonic() - start)
            self._append_action(traj, result, rid, sampling, turn)
            turn_ids += result.output_ids
            m.ACTION_TOKENS.inc(len(result.output_ids))
            if result.finish_reason != "abort":
                return turn_ids, result.finish_reason
            if len(turn_ids) >= max_new:
                return turn_ids, "length"
            m.PARTIAL_CONTINUATIONS.inc()
        raise EngineError(
            self.engine_url_hint(),
            200,
            None,
            f"turn {turn} aborted {self.limits.max_continuations + 1} times in a row",
        )

    def engine_url_hint(self) -> str:
        return ",".join(getattr(self.engine, "urls", []) or ["engine"])

    def _append_action(
        self,
        traj: Trajectory,
        result: GenerateResult,
        rid: str,
        sampling: SamplingParams,
        turn: int,
    ) -> None:
        """ACTION segments of one response: one per weight-version span (one unless an update
        landed inside the request without aborting it)."""
        ids, lps = result.output_ids, result.output_logprobs
        if not ids:
            return
        spans = result.weight_versions or ()
        if not spans or spans[0].start != 0 or spans[-1].end != len(ids):
            spans = ((result.weight_version, 0, len(ids)),)
        else:
            spans = tuple((s.version, s.start, s.end) for s in spans)
        for i, (version, start, end) in enumerate(spans):
            final = i == len(spans) - 1
            traj.segments.append(
                action_segment(
                    ids[start:end],
                    lps[start:end],
                    parse_version(version),
                    finish_reason=_FINISH[result.finish_reason]
                    if final
                    else FinishReason.FINISH_REASON_UNSPECIFIED,
                    request_id=rid,
                    sampling=sampling,
                    turn=turn,
                )
            )

    async def _exec(self, traj: Trajectory, session_id: str, command: str) -> tuple[str, ToolEvent]:
        """Run the command; a command the sandbox refuses as bad input (e.g. a NUL byte) is the
        model's error: the observation says so and the episode continues."""
        start = time.monotonic()
        try:
            result = await self.sandbox.exec(
                session_id, command, timeout_s=self.limits.exec_timeout_s
            )
        except SandboxBadRequest as exc:
            message = f"error: the sandbox refused the command: {(exc.body.get('error') or {}).get('message', exc)}"
            return render_parse_error(message), ToolEvent(
                command=command, exit_code=-1, parse_error=message
            )
        finally:
            m.EXEC_SECONDS.observe(time.monotonic() - start)
        verdict, rule = result.policy.verdict, result.policy.rule
        if verdict == "flag" and rule:
            traj.safety_events.append(rule)
        body = render_tool_response(
            result.stdout,
            result.stderr,
            result.exit_code,
            timed_out=result.timed_out,
            timeout_s=self.limits.exec_timeout_s,
            stdout_truncated_bytes=result.stdout_truncated_bytes,
            stderr_truncated_bytes=result.stderr_truncated_bytes,
            denied_rule=(rule or "denied") if verdict == "deny" else None,
            max_chars=self.limits.max_observation_chars,
        )
        event = ToolEvent(
            command=command,
            exit_code=result.exit_code if result.exit_code is not None else -1,
            duration_ms=result.duration_ms,
            timed_out=result.timed_out,
            stdout_truncated_bytes=result.stdout_truncated_bytes,
            stderr_truncated_bytes=result.stderr_truncated_bytes,
            policy_verdict=verdict or "",
            policy_rule=rule or "",
        )
        return body, event

    # --- sandbox sessions ------------------------------------------------------------------------

    async def _create_session(self, task: Task, traj: Trajectory) -> str:
        """A session with the task's setup and env; waits (does not fail) while the sandbox is full.
        Sets `env_version` to the sandbox's isolation layer."""
        start = time.monotonic()
        session, waited_s = await self.sandbox.create_session_when_free(
            poll_s=self.limits.sandbox_busy_poll_s,
            setup=task.setup,
            env=dict(task.env),
            policy=self.limits.sandbox_policy or None,
        )
        m.SESSION_SECONDS.observe(time.monotonic() - start - waited_s)  # the successful call
        if waited_s > 0:
            m.ADMISSION_WAIT_SECONDS.labels("sandbox_busy").observe(waited_s)
        traj.env_version = str(session.get("isolation", ""))
        return session["session_id"]

    async def _delete_session(self, session_id: str) -> None:
        if not session_id:
            return
        try:
            await self.sandbox.delete(session_id)
        except Exception as exc:  # already gone, or the sandbox is down: its TTL reaps it
            log.info("could not delete sandbox session %s: %s", session_id, exc)


def is_setup_failure(traj: Trajectory) -> bool:
    """The task's setup script failed: retrying the same task cannot help."""
    return traj.failure == Failure.FAILURE_INFRA_SANDBOX and traj.failure_detail.startswith(
        SETUP_FAILED
    )


def parse_version(version: str) -> int:
    """Engine `weight_version` (str) -> policy_version (int). SGLang's unset version is "default",
    which is the initial weights: version 0. Raises ValueError on any other non-integer."""
    if version in ("default", ""):
        return 0
    return int(version)


def _end(traj: Trajectory, end: int, *, terminated: bool = False, truncated: bool = False) -> None:
    traj.end, traj.terminated, traj.truncated = end, terminated, truncated


def _fail(traj: Trajectory, failure: int, detail: str) -> None:
    traj.failure, traj.failure_detail = failure, detail[:2000]
    traj.end, traj.terminated = EpisodeEnd.EPISODE_END_FAILURE, False
    log.warning("episode failed", extra={"failure": failure_label(failure), "detail": detail[:500]})


def _count(traj: Trajectory) -> None:
    if traj.failure != Failure.FAILURE_NONE:
        m.FAILURES.labels(failure_label(traj.failure)).inc()
    m.EPISODES.labels(EpisodeEnd.Name(traj.end).removeprefix("EPISODE_END_").lower()).inc()
    version = min_policy_version(traj)
    if version is not None and not traj.eval:
        m.VERSION_EPISODES.labels(str(version)).inc()
    if traj.finished_at and traj.created_at:
        m.EPISODE_SECONDS.observe(traj.finished_at - traj.created_at)
