"""What a stopped run's policy ran on each eval task, evaluation by evaluation (issue 33 item 1).

`shellrl show` needs the run's stack up; this reads a stopped run. It starts a private
`redis-server` on a copy of the run's AOF (`<state-dir>/redis`; the run's own files are never
written), reads the eval trajectories the verifier scored (`shellrl:evaluations`), decodes every
turn with the model's tokenizer and prints, per task of the chosen templates, each evaluation's
point (`before`, the step of an evaluation during training, `after`), the policy version of its
actions, the reward, the answer, and each command with the first line of what came back (the
error line where stdout was empty). The evaluation ids of each point come from
`<state-dir>/report/evaluations.json`; a point the run never reached (a run cut short) is left out.

    .venv/bin/python -m benchmarks.eval_actions .shellrl --set eval_ood \
        --templates file_size_bytes,last_line [--model-path smollm2] [--out actions.json]

Found with it (docs/runs/issue33-2026-12-06-cpu/old-prompt-s0/eval_ood_transcripts.txt): with the
prompt's old worked examples the base policy answered file_size_bytes by running the example's own
command, `wc -c < NAME`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from cli.launcher import answers_ping, die_with_parent
from shellrl.contract import min_policy_version, template_of
from shellrl.contract.trajectory import ACTION, decode_token_ids, parse_trajectory
from shellrl.service.ports import free_port
from shellrl.streams.keys import STREAM_EVALUATIONS
from shellrl.v1.trajectory_pb2 import Failure

LOAD_TIMEOUT_S = 300.0  # for redis-server to read the AOF copy (a long run's is ~100 MB)


def _evaluation_points(run_dir: Path, eval_set: str) -> dict[str, str]:
    """{evaluation id: its point ('before', 'k' during at step k, 'after')} of one eval set.
    Raises FileNotFoundError without report/evaluations.json, ValueError for a set it lacks."""
    path = run_dir / "report" / "evaluations.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a finished run's state dir (no report)")
    evaluations = json.loads(path.read_text())
    points: dict[str, str] = {}
    named = [("before", evaluations.get("before") or {})]
    named += [("", d) for d in evaluations.get("during") or []]
    named += [("after", evaluations.get("after") or {})]
    for name, sets in named:
        if eval_set in sets:
            points[sets[eval_set]["evaluation_id"]] = name or str(sets[eval_set]["policy_version"])
    if not points:
        found = sorted({s for _, sets in named for s in sets})
        raise ValueError(f"no evaluation of set {eval_set!r} in {path}; its sets: {found}")
    return points


class _RedisOnCopy:
    """redis-server on a copy of a run's AOF directory, on a free loopback port; stopped and the
    copy removed on exit, also when it fails to start."""

    def __init__(self, redis_dir: Path) -> None:
        if not redis_dir.is_dir():
            raise FileNotFoundError(f"{redis_dir}: no Redis data of a run here")
        self.redis_dir = redis_dir
        self.tmp: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.client = None

    def __enter__(self):
        try:
            return self._start()
        except BaseException:
            self.__exit__()
            raise

    def _start(self):
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not on PATH (apt-get install redis-server)")
        self.tmp = Path(tempfile.mkdtemp(prefix="shellrl-eval-actions-"))
        shutil.copytree(self.redis_dir, self.tmp, dirs_exist_ok=True)
        port, log = free_port(), self.tmp / "eval-actions-redis.log"
        self.proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.tmp)]
            + ["--appendonly", "yes", "--save", "", "--logfile", str(log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # never outlives this process
        )
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not answers_ping(port):  # -LOADING until the AOF is read
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(
                    f"redis-server on a copy of {self.redis_dir} did not come up:\n{tail}"
                )
            time.sleep(0.1)
        self.client = redis.Redis(port=port)
        return self.client

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _first_line(observation: str) -> str:
    """First line of a tool response's body; under a bare `stderr:` the error line itself."""
    body = observation.partition("<tool_response>")[2].partition("</tool_response>")[0]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
    if lines and lines[0] == "stderr:":
        lines = lines[1:]
    return lines[0] if lines else ""


def eval_actions(
    run_dir: Path, eval_set: str, templates: set[str] | None, model_path: str
) -> dict[str, list[dict]]:
    """{task id: [{point, policy_version, answer, reward, failure, turns: [[action, first line
    of its output]]}]} for the tasks of `templates` (all when None) in eval set `eval_set`, in
    evaluation order; reward None where the episode was not scored.

    Raises FileNotFoundError (no report or Redis data under run_dir), ValueError (no evaluation
    of `eval_set`, or no scored episode of it in the run's Redis), RuntimeError (redis-server).
    """
    from services.rollout.prompt import ChatFormat, load_chat_tokenizer

    chat = ChatFormat.from_tokenizer(load_chat_tokenizer(model_path))
    points = _evaluation_points(run_dir, eval_set)
    order = {p: i for i, p in enumerate(points.values())}
    found: dict[str, list[dict]] = {}
    matched = 0
    with _RedisOnCopy(run_dir / "redis") as client:
        start = "-"
        while entries := client.xrange(STREAM_EVALUATIONS, min=start, count=500):
            start = "(" + entries[-1][0].decode()  # the next page: after the last entry read
            for _entry_id, fields in entries:
                point = points.get(fields.get(b"evaluation_id", b"").decode())
                if point is None:
                    continue
                matched += 1
                traj = parse_trajectory(fields[b"pb"])
                if templates is not None and template_of(traj.task_id) not in templates:
                    continue
                turns: list[list[str]] = []
                for seg in traj.segments:
                    text = chat.decode_readable(decode_token_ids(seg.token_ids).tolist())
                    if seg.kind == ACTION:
                        turns.append([text.strip(), ""])
                    elif turns:
                        turns[-1][1] = _first_line(text)
                found.setdefault(traj.task_id, []).append(
                    {
                        "point": point,
                        "policy_version": min_policy_version(traj),
                        "answer": traj.answer,
                        "reward": traj.reward if math.isfinite(traj.reward) else None,
                        "failure": Failure.Name(traj.failure) if traj.failure else None,
                        "turns": turns,
                    }
                )
    if not matched:
        raise ValueError(
            f"no scored episode of evaluations {sorted(points)} in {run_dir / 'redis'}"
        )
    for rows in found.values():
        rows.sort(key=lambda r: order[r["point"]])
    return dict(sorted(found.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run's --state-dir (redis/ and report/)")
    p.add_argument("--set", default="eval_ood", help="eval set (default eval_ood)")
    p.add_argument("--templates", default="", help="comma-separated templates (default: all)")
    p.add_argument("--model-path", default="smollm2", help="the run's model (its tokenizer)")
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    a = p.parse_args(argv)
    templates = {t for t in a.templates.split(",") if t} or None
    found = eval_actions(a.run_dir, a.set, templates, a.model_path)
    for task_id, rows in found.items():
        print(f"== {task_id}")
        for r in rows:
            steps = " | ".join(f"{cmd!r} -> {out!r}" for cmd, out in r["turns"])
            print(
                f"  {r['point']:>6}  v{r['policy_version']}  reward {r['reward']}  "
                f"answer {r['answer']!r}  {steps}"
            )
    if a.out:
        a.out.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
