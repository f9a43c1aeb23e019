"""What a finished run's policy ran on each eval task, evaluation by evaluation (issue 33 item 1).

`shellrl show` needs the run's stack up; this reads a stopped run. It starts a private
`redis-server` on a copy of the run's AOF (`<state-dir>/redis`, so the run itself is never
written), reads the eval trajectories the verifier scored (`shellrl:evaluations`), decodes every
turn with the model's tokenizer and prints, per task of the chosen templates, each evaluation's
policy version, answer, reward and the commands run with the first line of their output.
The evaluation order (before, during at step k, after) comes from `<state-dir>/report/
evaluations.json`.

    .venv/bin/python -m benchmarks.eval_actions .shellrl --set eval_ood \
        --templates file_size_bytes,last_line [--model-path smollm2] [--out actions.json]

Found with it (docs/runs/issue33-2026-12-06-cpu/old-prompt-s0/eval_ood_transcripts.txt): with the
prompt's old worked examples the base policy answered file_size_bytes by running the example's own
command, `wc -c < NAME`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from cli.launcher import die_with_parent
from shellrl.contract import template_of
from shellrl.contract.trajectory import ACTION, decode_token_ids, parse_trajectory
from shellrl.service.ports import free_port
from shellrl.streams.keys import STREAM_EVALUATIONS


def _evaluation_points(run_dir: Path, eval_set: str) -> dict[str, str]:
    """{evaluation id: its point ('0' before, 'k' during at step k, 'after')} of one eval set."""
    evaluations = json.loads((run_dir / "report" / "evaluations.json").read_text())
    points = {evaluations["before"][eval_set]["evaluation_id"]: "0"}
    for during in evaluations.get("during", []):
        if eval_set in during:
            points[during[eval_set]["evaluation_id"]] = str(during[eval_set]["policy_version"])
    points[evaluations["after"][eval_set]["evaluation_id"]] = "after"
    return points


class _ReadOnlyCopy:
    """redis-server on a copy of a run's AOF directory, on a free loopback port; stopped on exit."""

    def __init__(self, redis_dir: Path) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="shellrl-eval-actions-"))
        shutil.copytree(redis_dir, self.tmp, dirs_exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not on PATH (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.tmp)]
            + ["--appendonly", "yes", "--save", "", "--logfile", str(self.tmp / "redis.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # never outlives this process
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 60
        while True:  # PING answers LOADING while the AOF is read
            try:
                if client.ping():
                    return client
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"redis-server on the copy did not come up; see {self.tmp}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def eval_actions(
    run_dir: Path, eval_set: str, templates: set[str] | None, model_path: str
) -> dict[str, list[dict]]:
    """{task id: [{point, policy_version, answer, reward, turns: [[action, first output line]]}]}
    for the tasks of `templates` (all when None) in eval set `eval_set`, in evaluation order."""
    from services.rollout.prompt import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(model_path)
    points = _evaluation_points(run_dir, eval_set)
    order = {p: i for i, p in enumerate(points.values())}
    found: dict[str, list[dict]] = {}
    with _ReadOnlyCopy(run_dir / "redis") as client:
        for _id, fields in client.xrange(STREAM_EVALUATIONS):
            point = points.get(fields[b"evaluation_id"].decode())
            if point is None:
                continue
            traj = parse_trajectory(fields[b"pb"])
            if templates is not None and template_of(traj.task_id) not in templates:
                continue
            turns: list[list[str]] = []
            for seg in traj.segments:
                text = tokenizer.decode(decode_token_ids(seg.token_ids), skip_special_tokens=True)
                if seg.kind == ACTION:
                    turns.append([text.strip(), ""])
                elif turns:  # the template's turn boundaries, then <tool_response>BODY</...>
                    body = text.partition("<tool_response>")[2].partition("</tool_response>")[0]
                    turns[-1][1] = next((ln for ln in body.splitlines() if ln.strip()), "")
            found.setdefault(traj.task_id, []).append(
                {
                    "point": point,
                    "policy_version": min(
                        (s.policy_version for s in traj.segments if s.kind == ACTION), default=0
                    ),
                    "answer": traj.answer,
                    "reward": traj.reward,
                    "turns": turns,
                }
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
            print(f"  {r['point']:>5}  reward {r['reward']:g}  answer {r['answer']!r}  {steps}")
    if a.out:
        a.out.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
