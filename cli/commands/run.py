"""The main job: start the stack, evaluate, train with live progress, evaluate again, and write
`<state>/report/` (report.md and PNG plots). What `make run` calls.

    shellrl run [--steps 30] [--group-size 8] [--max-staleness 1] [--model-path smollm2] ...
"""

from __future__ import annotations

NAME = "run"
HELP = "the main job: stack up, eval, train, eval, report (what `make run` calls)"


def add_arguments(parser) -> None:
    from cli.main_job import JobConfig

    d = JobConfig()
    parser.add_argument("--model-path", default=d.model_path, help="smollm2 (default), tiny, or a HF directory")
    parser.add_argument("--state-dir", default=str(d.state_dir))
    parser.add_argument("--steps", type=int, default=d.steps, help="learner steps (policy versions)")
    parser.add_argument("--time-budget-min", type=float, default=d.time_budget_s / 60, help="training stops after this")
    parser.add_argument("--group-size", type=int, default=d.group_size)
    parser.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    parser.add_argument("--max-staleness", type=int, default=d.max_staleness)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--kl-coef", type=float, default=d.kl_coef, help="k3 KL to the initial policy (0 = off)")
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--max-turns", type=int, default=d.max_turns)
    parser.add_argument("--engine-threads", type=int, default=d.engine_threads,
                        help="torch threads of the engine (0 = torch's default)")
    parser.add_argument("--learner-threads", type=int, default=d.learner_threads,
                        help="torch threads of the learner (0 = torch's default)")
    parser.add_argument("--train-set", default=d.train_set, help="curriculum (default), default, generated, or a .jsonl")
    parser.add_argument("--eval-id-episodes", type=int, default=d.eval_id_episodes)
    parser.add_argument("--eval-ood-episodes", type=int, default=d.eval_ood_episodes)
    parser.add_argument("--agentbench-eval-tasks", type=int, default=d.agentbench_eval_tasks)
    parser.add_argument("--no-require-command", dest="require_command", action="store_false",
                        help="train on successes that ran no command too (off by default: guesses get amplified)")
    parser.add_argument("--fresh", action="store_true", help="delete <state-dir> first (Redis, checkpoints, logs)")


def run(args) -> int:
    import shutil
    from pathlib import Path

    from cli.main_job import JobConfig, run_job

    state = Path(args.state_dir)
    if args.fresh and state.exists():
        shutil.rmtree(state)
    cfg = JobConfig(model_path=args.model_path, state_dir=state, steps=args.steps,
                    time_budget_s=args.time_budget_min * 60, group_size=args.group_size,
                    groups_per_step=args.groups_per_step, max_staleness=args.max_staleness, lr=args.lr, kl_coef=args.kl_coef,
                    temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                    train_set=args.train_set, eval_id_episodes=args.eval_id_episodes,
                    eval_ood_episodes=args.eval_ood_episodes, agentbench_eval_tasks=args.agentbench_eval_tasks,
                    engine_threads=args.engine_threads, learner_threads=args.learner_threads,
                    require_command=args.require_command)
    try:
        run_job(cfg)
    except KeyboardInterrupt:  # the Stack context manager has stopped every process by now
        print("interrupted: the stack is stopped; logs and checkpoints stay in", state)
        return 130
    return 0
