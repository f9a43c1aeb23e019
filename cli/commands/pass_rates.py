"""Measure the base policy's pass rate per task template at the training temperature (starts the
stack unless --rollout-url points at a running one) and write them as JSON, with the templates in
the learnable band (see cli/pass_rates.py); the main job's curriculum was chosen from them.

    shellrl pass-rates [--temperature 1.0] [--tasks-per-template 4] [--episodes-per-task 4] [--templates a,b]
"""

from __future__ import annotations

NAME = "pass-rates"
HELP = "measure the base policy's pass rate per template (what GRPO can learn from)"


def add_arguments(parser) -> None:
    """The flags of PassRatesOptions (cli/tool_options.py; also
    SHELLRL_CLI_PASS_RATES_<OPTION>)."""
    from cli.options import add_options
    from cli.tool_options import PassRatesOptions

    add_options(parser, PassRatesOptions)
    parser.set_defaults(_options=PassRatesOptions)


def run(args) -> int:
    import shutil
    import time
    from pathlib import Path

    from cli import pass_rates as pr
    from cli.console import cli_console
    from cli.model_path import check_model_path

    if not args.rollout_url:
        check_model_path(args.model_path)
    kw = dict(
        tasks_per_template=args.tasks_per_template,
        episodes_per_task=args.episodes_per_task,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        templates=tuple(t for t in args.templates.split(",") if t) or None,
    )
    out = Path(args.out or f"docs/runs/pass-rates/pass_rates_T{args.temperature:g}.json")
    t0 = time.time()
    if args.rollout_url:
        rates, _ = pr.measure(args.rollout_url, **kw)
    else:
        from cli.launcher import Stack
        from cli.stack_config import SERVICE_ORDER, StackConfig

        state = Path(args.state_dir)
        shutil.rmtree(state, ignore_errors=True)
        cfg = StackConfig(
            state_dir=state,
            model_path=args.model_path,
            echo_logs=False,
            env={
                "SHELLRL_MAX_TURNS": str(args.max_turns),
                "SHELLRL_MAX_NEW_TOKENS": str(args.max_new_tokens),
                "SHELLRL_EVAL_MAX_IN_FLIGHT": "32",
            },
            service_env={"engine": {"SHELLRL_NUM_THREADS": str(args.engine_threads)}},
            services=tuple(s for s in SERVICE_ORDER if s != "learner"),
        )  # nothing trains
        with Stack(cfg) as stack:
            rates, _ = pr.measure(
                stack.config.url("rollout"), headers=stack.config.auth_headers(), **kw
            )
    meta = {
        "model_path": args.model_path,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "max_turns": args.max_turns,
        "tasks_per_template": args.tasks_per_template,
        "episodes_per_task": args.episodes_per_task,
        "seconds": round(time.time() - t0, 1),
        "command": "shellrl pass-rates "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items() if k != "templates")
        + (f" --templates {args.templates}" if args.templates else ""),
        "band": [pr.MIN_PASS_RATE, pr.MAX_PASS_RATE],
    }
    pr.write(out, rates, meta)
    cli_console().print(pr.table(rates, 8))
    print(f"written: {out} ({meta['seconds']} s); curriculum: {pr.select_templates(rates)}")
    return 0
