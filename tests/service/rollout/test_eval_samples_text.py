"""The job's eval samples table (cli/job_tracking.py `eval_samples`, issue 34) shows the episode's
text without the chat template's special tokens: a real gateway process (worker off, bearer token
on) over real Redis decodes, with the real tiny tokenizer, a trajectory whose prompt, actions and
observations are the token ids ChatFormat made (so `<|im_start|>`, `<|im_end|>` are in them).
GET /v1/trajectories/{id} without `skip_special_tokens` still answers them (the policy's view)."""

from __future__ import annotations

import httpx
import pytest

from cli.job_tracking import SAMPLE_COLUMNS, eval_samples
from services.rollout.prompt import ChatFormat
from shellrl.contract import action_segment, observation_segment
from shellrl.streams import STREAM_EVALUATIONS
from shellrl.v1.trajectory_pb2 import EpisodeEnd, ToolEvent, Trajectory
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.service.rollout.conftest import make_task
from tests.service.rollout.test_transcripts import publish

TOKEN = "eval-samples-text-token-0123456789abcdef"
INSTRUCTION = "How many lines does numbers.txt have?"
MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def gateway(module_redis_server, tmp_path_factory):
    proc = ServiceProcess(
        "rollout",
        free_port(),
        {
            "SHELLRL_REDIS_URL": module_redis_server.url,
            "SHELLRL_API_TOKEN": TOKEN,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_WORKER_ENABLED": "false",
        },
        tmp_path_factory.mktemp("eval-samples-logs"),
    ).start(120)
    yield proc
    proc.stop()


def episode(chat: ChatFormat) -> Trajectory:
    """An eval episode as the agent loop builds it: the chat template's prompt, `ls` ended by
    <|im_end|>, the tool response turn, then the answer."""
    end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first, second = (
        chat.encode("<bash>ls</bash>") + [end],
        chat.encode("<answer>5</answer>") + [end],
    )
    output = chat.observation_ids("<tool_response>\nnumbers.txt\n</tool_response>", first)
    traj = Trajectory(
        trajectory_id="eval-text-1",
        task_id="t-lines",
        prompt_ids=b"".join(i.to_bytes(4, "little") for i in chat.prompt_ids(INSTRUCTION)),
        task=make_task(INSTRUCTION),
        num_turns=2,
        answer="5",
        end=EpisodeEnd.EPISODE_END_ANSWER,
        scored=True,
        reward=1.0,
        training_reward=1.0,
        eval=True,
        evaluation_id="eval-text",
    )
    traj.segments.extend(
        [
            action_segment(first, [0.0] * len(first), 1, turn=0),
            observation_segment(output, tool_event=ToolEvent(command="ls", exit_code=0), turn=0),
            action_segment(second, [0.0] * len(second), 1, turn=1),
        ]
    )
    return traj


def test_eval_samples_show_the_text_without_the_chat_templates_special_tokens(
    gateway, module_redis_server, chat
):
    publish(module_redis_server.url, STREAM_EVALUATIONS, episode(chat))
    view = {
        "results": [{"task_id": "t-lines", "outcome": "success", "trajectory_id": "eval-text-1"}]
    }
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=gateway.url, headers=headers) as client:
        [row] = eval_samples(client, view)
        raw = client.get("/v1/trajectories/eval-text-1", timeout=30).json()
    sample = dict(zip(SAMPLE_COLUMNS, row, strict=True))
    assert not [m for m in MARKERS if m in sample["prompt"] + sample["transcript"]], sample
    assert sample["prompt"].endswith(f"user\n{INSTRUCTION}\nassistant\n"), sample["prompt"]
    assert sample["transcript"] == (
        "<bash>ls</bash>\nuser\n<tool_response>\nnumbers.txt\n</tool_response>\nassistant\n"
        "<answer>5</answer>"
    ), sample["transcript"]
    assert (sample["task_id"], sample["outcome"], sample["reward"], sample["turns"]) == (
        "t-lines",
        "success",
        1.0,
        2,
    )
    # the default answer is the policy's view: the markers kept, the token ids the same
    assert raw["prompt"]["text"].endswith(
        f"<|im_start|>user\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert raw["turns"][0]["segments"][0]["text"] == "<bash>ls</bash><|im_end|>"
