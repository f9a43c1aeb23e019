"""The main job's configuration (`JobConfig`: the flags of `shellrl run`): the recipe the services
run (cli/recipe.py, what `shellrl up` starts too) and the job's own knobs (steps, time budget,
task sets, evaluations, tracking), and the StackConfig of the stack it starts (`stack_config`).
cli/main_job.py runs it; cli/options.py's RunOptions has its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from cli.recipe import Recipe
from cli.stack_config import GPU_MEMORY_FRACTIONS, StackConfig, launcher_names, shifted_ports


@dataclass
class JobConfig(Recipe):
    """Knobs of the main job (flags of `shellrl run`): the recipe (cli/recipe.py, what `shellrl
    up` starts too) and the job's own."""

    model_path: str = "smollm2"
    state_dir: Path = Path(".shellrl")
    # where engine and learner run: cpu, or cuda (on one GPU or two, each within its fraction of its
    # GPU's memory: cli/stack_config.py, GPU_MEMORY_FRACTIONS and GPU_LAYOUTS)
    device: str = "cpu"
    gpu_layout: str = "colocated"  # with device 'cuda': what check_device resolved (GPU_LAYOUTS)
    engine_gpu_memory: float = GPU_MEMORY_FRACTIONS["engine"]
    learner_gpu_memory: float = GPU_MEMORY_FRACTIONS["learner"]
    port_offset: int = 0  # every port of the stack moved by this (cli/stack_config.py)
    steps: int = 40
    # training time; the job adds ~7 min (start, evaluations before and after, report): runs 4-5 took
    # 23.9-25.2 min with 17 min, so 20 min keeps the whole job under 30 min with more steps
    time_budget_s: float = 20 * 60.0
    train_set: str = "curriculum"
    eval_id_episodes: int = 64
    eval_ood_episodes: int = 32
    agentbench_eval_tasks: int = 8
    # the generated task sets (training pool and eval sets): fixed, so runs of any seed compare
    task_seed: int = 0
    # episodes per eval task and their temperature: 1 and 0.0 = greedy; K > 1 needs T > 0
    eval_samples: int = 1
    eval_temperature: float = 0.0
    # evaluate eval_id and eval_ood every this many steps during training too (0: off, the
    # default): each pauses the learner for ~1-2 min on 2 cores (96 greedy episodes), outside the
    # time budget, so 10 on the default 40 steps adds 3 evaluations, ~3-6 min to the job
    eval_every_steps: int = 0
    # after each evaluation during and after training, the KL to the initial policy on its
    # eval_id and eval_ood episodes per template (cli/job_eval_kl.py: two no-grad forwards per
    # episode on the paused learner, ~1 min on 2 cores)
    eval_kl: bool = False
    # experiment tracking (shellrl/tracking.py) of the job's evaluations and, through the learner's
    # SHELLRL_TRACKER, of its steps: auto = TensorBoard under <state>/tracking/{job,learner} when
    # installed
    tracker: str = "auto"
    extra_env: dict = field(default_factory=dict)

    def stack_config(self) -> StackConfig:
        state = self.state_dir.resolve()
        env = {
            "SHELLRL_CHECKPOINT_DIR": str(state / "checkpoints"),
            "SHELLRL_WEIGHT_SYNC_DIR": str(state / "weight_sync"),
            **self.env(),
            **self.extra_env,
        }
        service_env = self.service_env()
        service_env["learner"] |= {
            # nothing trains before the job's evaluation (a rerun's stream may hold
            # trajectories of the run before): POST /v1/resume when training starts
            "SHELLRL_START_PAUSED": "true",
            "SHELLRL_MAX_STEPS": str(self.steps),  # --steps exactly, never a step past
            "SHELLRL_TRACKER": self.tracker,
            "SHELLRL_TRACKING_DIR": str(state / "tracking"),
        }
        return StackConfig(
            state_dir=self.state_dir,
            model_path=self.model_path,
            env=env,
            service_env=service_env,
            echo_logs=False,
            device=self.device,
            gpu_memory=self.gpu_memory(),
            gpu_layout=self.gpu_layout,
            ports=shifted_ports(self.port_offset),
        )

    def gpu_memory(self) -> dict[str, float]:
        """GPU memory fraction of each colocated service (used with device 'cuda')."""
        return {"engine": self.engine_gpu_memory, "learner": self.learner_gpu_memory}

    def managed_env(self) -> set[str]:
        """SHELLRL_* names the job sets from its own options or the launcher sets (ports, URLs,
        the device's): `extra_env` (a config file's [env] table) may not set them."""
        return launcher_names(replace(self, extra_env={}).stack_config())
