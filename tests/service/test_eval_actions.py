"""benchmarks/eval_actions.py reads a stopped run's eval episodes from a copy of its AOF (issue 33
item 1): a real redis-server writes the run's AOF, is stopped, and the tool's own redis-server on
the copy gives back each task's commands, answers and rewards in evaluation order, leaving the
run's files as they were."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.eval_actions import eval_actions
from services.rollout.prompt import ChatFormat, load_chat_tokenizer, render_tool_response
from shellrl.contract.trajectory import action_segment, observation_segment
from shellrl.streams.keys import STREAM_EVALUATIONS
from shellrl.v1.trajectory_pb2 import Trajectory
from tests.helpers.redis_server import RedisServer


def _episode(chat, task_id, evaluation_id, command, stdout, stderr, answer, reward, version):
    tok = chat.tokenizer
    act = tok(f"<bash>{command}</bash>", add_special_tokens=False)["input_ids"]
    obs = chat.observation_ids(render_tool_response(stdout, stderr), act)
    fin = tok(f"<answer>{answer}</answer>", add_special_tokens=False)["input_ids"]
    traj = Trajectory(
        trajectory_id=f"{evaluation_id}-{task_id}-0",
        task_id=task_id,
        evaluation_id=evaluation_id,
        answer=answer,
        reward=reward,
        eval=True,
    )
    traj.segments.extend(
        [
            action_segment(act, [0.0] * len(act), version, turn=0),
            observation_segment(obs, turn=0),
            action_segment(fin, [0.0] * len(fin), version, turn=1),
        ]
    )
    return {"pb": traj.SerializeToString(), "task_id": task_id, "evaluation_id": evaluation_id}


def _write_run(chat, run, evaluations):
    server = RedisServer(run / "redis").start()
    try:
        import redis

        client = redis.Redis(port=server.port)
        task, other = "gen-file_size_bytes-aaaaaaaaaaaa", "gen-last_line-bbbbbbbbbbbb"
        # appended out of order: after, during, before, then a task of another template
        for episode in (
            (task, "eval-2", "wc -l < a.txt", "7\n", "", "7", 0.0, 40),
            (task, "eval-1", "wc -d < a.txt", "", "wc: invalid option -- 'd'\n", "1", 0.0, 20),
            (task, "eval-0", "wc -c < a.txt", "200\n", "", "200", 1.0, 0),
            (other, "eval-0", "tail -n 1 b.log", "x 1\n", "", "x 1", 1.0, 0),
        ):
            client.xadd(STREAM_EVALUATIONS, _episode(chat, *episode))
        client.close()
    finally:
        server.stop()
    (run / "report").mkdir()
    (run / "report" / "evaluations.json").write_text(json.dumps(evaluations))
    return task, other


def _files(directory):
    return sorted(
        (p.name, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in directory.rglob("*")
        if p.is_file()
    )


def _copies():
    return set(Path(tempfile.gettempdir()).glob("shellrl-eval-actions-*"))


def test_a_stopped_runs_eval_commands_come_back_in_evaluation_order(tmp_path):
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    run = tmp_path / "run"
    evaluations = {
        "before": {"eval_ood": {"evaluation_id": "eval-0"}},
        "during": [{"eval_ood": {"evaluation_id": "eval-1", "policy_version": 20}}],
        "after": {"eval_ood": {"evaluation_id": "eval-2"}},
    }
    task, other = _write_run(chat, run, evaluations)
    files_before, copies_before = _files(run / "redis"), _copies()

    found = eval_actions(run, "eval_ood", {"file_size_bytes"}, "tiny")

    assert list(found) == [task]
    before, during, after = found[task]
    assert (before["point"], before["answer"], before["reward"]) == ("before", "200", 1.0)
    assert before["policy_version"] == 0 and before["failure"] is None
    assert before["turns"] == [["<bash>wc -c < a.txt</bash>", "200"], ["<answer>200</answer>", ""]]
    # stdout empty: the error line, not the bare "stderr:" header
    assert (during["point"], during["policy_version"]) == ("20", 20)
    assert during["turns"][0] == ["<bash>wc -d < a.txt</bash>", "wc: invalid option -- 'd'"]
    assert (after["point"], after["answer"], after["reward"]) == ("after", "7", 0.0)
    assert after["turns"][0] == ["<bash>wc -l < a.txt</bash>", "7"]
    assert set(eval_actions(run, "eval_ood", None, "tiny")) == {task, other}
    assert _files(run / "redis") == files_before  # the run's own AOF is never written
    assert _copies() == copies_before  # every copy removed, its server stopped with it


def test_a_run_cut_short_or_an_unknown_set_gives_what_there_is_or_a_clear_error(tmp_path):
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    run = tmp_path / "run"
    evaluations = {"before": {"eval_ood": {"evaluation_id": "eval-0"}}, "after": {}}
    task, _other = _write_run(chat, run, evaluations)

    assert [r["point"] for r in eval_actions(run, "eval_ood", None, "tiny")[task]] == ["before"]
    with pytest.raises(ValueError, match="no evaluation of set 'eval_id'.*eval_ood"):
        eval_actions(run, "eval_id", None, "tiny")
    with pytest.raises(FileNotFoundError, match="no report"):
        eval_actions(tmp_path, "eval_ood", None, "tiny")
