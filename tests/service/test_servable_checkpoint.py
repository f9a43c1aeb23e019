"""Servable checkpoints (issue 22, item 4): every learner checkpoint, and what `shellrl export`
writes, is a complete Hugging Face directory that transformers loads and that the engine serves
as its `--model-path`, with the trained weights (not the base model's)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from cli.model_path import check_model_path
from services.learner.checkpoint import CheckpointStore, LearnerState
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from shellrl.models import load_model, load_tokenizer, resolve_model_path
from shellrl.rl.batch import build_batch
from tests.helpers.logprob_reference import compute
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO, ServiceProcess
from tests.helpers.redis_server import free_port
from tests.unit.test_rl_logprobs import make_samples

SERVABLE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of the tiny model after one real learner step (lr large enough to move it)."""
    torch.manual_seed(0)
    model = load_model("tiny")
    trainer = Trainer(model, TrainerConfig(lr=1e-2, micro_batch_size=2))
    trainer.step(build_batch(make_samples(4, seed=0), pad_token_id=2), learner_version=0)
    store = CheckpointStore(tmp_path_factory.mktemp("checkpoints"))
    path = store.save(trainer, LearnerState(step=1, version=1))
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return path, trained


def shellrl(*args: str) -> subprocess.CompletedProcess:
    return run_owned(
        [sys.executable, "-m", "cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout_s=300,
    )


def test_a_learner_checkpoint_is_a_complete_hf_directory_transformers_loads(checkpoint):
    path, trained = checkpoint
    assert SERVABLE_FILES <= {p.name for p in path.iterdir()}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # the training dtype
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.dtype == torch.float32
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items())
    base = load_model("tiny").state_dict()
    assert any(
        not torch.equal(base[k], v) for k, v in trained.items()
    )  # the step moved the weights
    tokenizer = AutoTokenizer.from_pretrained(path)
    base_tokenizer = load_tokenizer("tiny")
    messages = [{"role": "user", "content": "How many lines does numbers.txt have?"}]
    assert tokenizer.apply_chat_template(
        messages, tokenize=False
    ) == base_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer("ls -la | wc -l").input_ids == base_tokenizer("ls -la | wc -l").input_ids
    assert GenerationConfig.from_pretrained(path).eos_token_id == loaded.config.eos_token_id
    check_model_path(str(path))  # what `shellrl run --model-path` accepts


def test_the_engine_serves_a_checkpoint_given_as_model_path(checkpoint, tmp_path):
    path, _ = checkpoint
    engine = ServiceProcess(
        "engine",
        free_port(),
        {"SHELLRL_LOG_LEVEL": "WARNING", "SHELLRL_NUM_THREADS": "1"},
        tmp_path,
        args=["--model-path", str(path)],
    ).start(ready_timeout_s=180)
    try:
        prompt = load_tokenizer("tiny")("echo hello").input_ids
        done = httpx.post(
            f"{engine.url}/generate",
            timeout=120,
            json={
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {
                    "temperature": 1.0,
                    "max_new_tokens": 8,
                    "ignore_eos": True,
                    "sampling_seed": 7,
                },
            },
        )
        assert done.status_code == 200, done.text
        body = done.json()
        output = body["output_ids"]
        served = [lp for lp, *_ in body["meta_info"]["output_token_logprobs"]]
    finally:
        engine.stop()
    case = {"prompt": prompt, "output": output, "temperature": 1.0}
    [expected] = compute({"model": str(path), "cases": [case]})
    [base] = compute({"model": "tiny", "cases": [case]})
    assert len(output) == 8
    assert max(abs(a - b) for a, b in zip(served, expected)) <= 1e-4  # the checkpoint's weights ...
    assert max(abs(a - b) for a, b in zip(served, base)) > 1e-3  # ... not the base model's


def test_shellrl_export_writes_a_servable_directory_without_training_state(checkpoint, tmp_path):
    path, trained = checkpoint
    out = tmp_path / "policy-bf16"
    done = shellrl("export", str(path), str(out), "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    names = {p.name for p in out.iterdir()}
    assert SERVABLE_FILES <= names and not names & {"trainer.pt", "rng.pt", "state.json"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in trained.items())
    assert (
        AutoTokenizer.from_pretrained(out)("pwd").input_ids
        == load_tokenizer("tiny")("pwd").input_ids
    )
    again = shellrl("export", str(path), str(out))
    assert again.returncode == 2 and "not an empty directory" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_export_of_a_checkpoint_without_a_tokenizer_takes_it_from_the_base_model(
    checkpoint, tmp_path
):
    path, _ = checkpoint
    old = tmp_path / "step-000001"  # as checkpoints were before they carried the tokenizer
    old.mkdir()
    for name in ("config.json", "model.safetensors", "state.json"):
        (old / name).write_bytes((path / name).read_bytes())
    (old / "trainer.pt").write_bytes(b"")  # their training state (now train/, a DCP directory)
    refused = shellrl("export", str(old), str(tmp_path / "a"))
    assert (
        refused.returncode == 2
        and "no tokenizer" in refused.stderr
        and "Traceback" not in refused.stderr
    )
    done = shellrl("export", str(old), str(tmp_path / "b"), "--tokenizer-from", "tiny")
    assert done.returncode == 0, done.stderr
    base_tokenizer = (resolve_model_path("tiny") / "tokenizer.json").read_bytes()
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == base_tokenizer
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "b").dtype == torch.float32


def _modes(directory) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode)
        for p in [directory, *directory.rglob("*")]
    }


def test_shellrl_export_writes_world_readable_files_in_the_users_directory(checkpoint, tmp_path):
    """Issue 32: exported model.safetensors was 0600, unreadable by a server running as another
    user. Files 0644, directories 0755, owned by the user who exported."""
    path, _ = checkpoint
    out = tmp_path / "exported"
    done = shellrl("export", str(path), str(out))
    assert done.returncode == 0, done.stderr
    modes = _modes(out)
    assert modes.pop(".") == 0o755 and modes["model.safetensors"] == 0o644
    assert set(modes.values()) <= {0o644, 0o755}, modes
    assert {p.stat().st_uid for p in [out, *out.rglob("*")]} == {os.getuid()}


def test_a_learner_checkpoints_model_files_are_world_readable(checkpoint):
    path, _ = checkpoint
    modes = {k: v for k, v in _modes(path).items() if not k.startswith("train")}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) <= {0o644, 0o755}, modes
