"""The job's KL on eval episodes per template (cli/job_eval_kl.py): the sequence it sends for a
transcript, the sums per template from the learner's answers, and report.md's table. The
learner's side (POST /v1/kl) is tests/unit/test_learner_template_kl.py; the whole path runs in
tests/e2e/test_job_during_evals.py."""

from __future__ import annotations

import json

import httpx

from cli.job_eval_kl import eval_kl, markdown_section, sequence

A, B = "gen-count_lines-00000000000a", "gen-file_size_bytes-00000000000b"


def transcript(prompt: list[int], segments: list[tuple[str, list[int]]]) -> dict:
    return {
        "prompt": {"token_ids": prompt},
        "turns": [{"turn": 0, "segments": [{"kind": k, "token_ids": ids} for k, ids in segments]}],
    }


def test_action_tokens_are_sampled_and_observations_are_not():
    body, sampled = sequence(transcript([1, 2], [("action", [3, 4]), ("observation", [5])]))
    assert body == {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "loss_mask": [1, 1, 0]}
    assert sampled == 2


def test_kl_per_template_sums_the_learners_answers_and_counts_missing_transcripts():
    transcripts = {
        "t1": transcript([1], [("action", [2, 3])]),
        "t2": transcript([1], [("action", [4])]),
        "t3": transcript([1], [("action", [5, 6, 7])]),
    }
    answers = {2: 0.2, 1: 0.4, 3: 0.3}  # kl_sum by sampled tokens of the sequence

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/trajectories/"):
            tid = request.url.path.rsplit("/", 1)[1]
            if tid not in transcripts:
                return httpx.Response(404, json={"error": {"code": "not_found"}})
            return httpx.Response(200, json=transcripts[tid])
        sequences = json.loads(request.content)["sequences"]
        rows = [
            {"kl_sum": answers[sum(s["loss_mask"])], "tokens": sum(s["loss_mask"])}
            for s in sequences
        ]
        return httpx.Response(200, json={"step": 3, "sequences": rows})

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x")
    views = {
        "eval_id": {
            "policy_versions_seen": [3],
            "results": [
                {"task_id": A, "trajectory_id": "t1"},
                {"task_id": A, "trajectory_id": "t2"},
                {"task_id": A, "trajectory_id": "gone"},
            ],
        },
        "eval_ood": {
            "policy_versions_seen": [3],
            "results": [{"task_id": B, "trajectory_id": "t3"}],
        },
    }
    out = eval_kl(client, client, views, {})
    assert out["step"] == 3 and out["missing"] == 1
    assert out["eval_id"]["count_lines"] == {"tokens": 3, "episodes": 2, "kl": (0.2 + 0.4) / 3}
    ood = out["eval_ood"]["file_size_bytes"]
    assert (ood["tokens"], ood["episodes"]) == (3, 1) and abs(ood["kl"] - 0.1) < 1e-12
    text = "\n".join(markdown_section([out]))
    assert "| eval_id: count_lines | 3: 0.2 |" in text
    assert "| eval_ood: file_size_bytes | 3: 0.1 |" in text
    assert "1 episodes' transcripts were gone" in text
    assert markdown_section([]) == []
