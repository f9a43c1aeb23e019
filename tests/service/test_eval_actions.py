"""benchmarks/eval_actions.py reads a stopped run's eval episodes from a copy of its AOF (issue 33
item 1): a real redis-server writes the run's AOF, is stopped, and the tool's own redis-server on
the copy gives back each task's commands, answers and rewards in evaluation order, leaving the
run's files as they were."""

from __future__ import annotations

import json

from benchmarks.eval_actions import eval_actions
from services.rollout.prompt import ChatFormat, load_chat_tokenizer, render_tool_response
from shellrl.contract.trajectory import action_segment, observation_segment
from shellrl.streams.keys import STREAM_EVALUATIONS
from shellrl.v1.trajectory_pb2 import Trajectory
from tests.helpers.redis_server import RedisServer


def _episode(chat, task_id, evaluation_id, command, output, answer, reward, version):
    tok = chat.tokenizer
    act = tok(f"<bash>{command}</bash>", add_special_tokens=False)["input_ids"]
    obs = chat.observation_ids(render_tool_response(output), act)
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


def test_a_stopped_runs_eval_commands_come_back_in_evaluation_order(tmp_path):
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    run = tmp_path / "run"
    server = RedisServer(run / "redis").start()
    try:
        import redis

        client = redis.Redis(port=server.port)
        task, other = "gen-file_size_bytes-aaaaaaaaaaaa", "gen-last_line-bbbbbbbbbbbb"
        # appended out of order: after, before, then a task of another template
        client.xadd(
            STREAM_EVALUATIONS, _episode(chat, task, "eval-2", "wc -l < a.txt", "7\n", "7", 0.0, 40)
        )
        client.xadd(
            STREAM_EVALUATIONS,
            _episode(chat, task, "eval-0", "wc -c < a.txt", "200\n", "200", 1.0, 0),
        )
        client.xadd(
            STREAM_EVALUATIONS,
            _episode(chat, other, "eval-0", "tail -n 1 b.log", "x 1\n", "x 1", 1.0, 0),
        )
        client.close()
    finally:
        server.stop()
    (run / "report").mkdir()
    (run / "report" / "evaluations.json").write_text(
        json.dumps(
            {
                "before": {"eval_ood": {"evaluation_id": "eval-0"}},
                "during": [],
                "after": {"eval_ood": {"evaluation_id": "eval-2"}},
            }
        )
    )
    files_before = sorted(
        (p.name, p.stat().st_size) for p in (run / "redis").rglob("*") if p.is_file()
    )

    found = eval_actions(run, "eval_ood", {"file_size_bytes"}, "tiny")

    assert list(found) == [task]
    before, after = found[task]
    assert (before["point"], before["answer"], before["reward"], before["policy_version"]) == (
        "0",
        "200",
        1.0,
        0,
    )
    assert before["turns"] == [["<bash>wc -c < a.txt</bash>", "200"], ["<answer>200</answer>", ""]]
    assert (after["point"], after["answer"], after["reward"], after["policy_version"]) == (
        "after",
        "7",
        0.0,
        40,
    )
    assert after["turns"][0] == ["<bash>wc -l < a.txt</bash>", "7"]
    assert set(eval_actions(run, "eval_ood", None, "tiny")) == {task, other}
    files_after = sorted(
        (p.name, p.stat().st_size) for p in (run / "redis").rglob("*") if p.is_file()
    )
    assert files_after == files_before
