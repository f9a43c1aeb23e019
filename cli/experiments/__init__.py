"""The three infrastructure experiments (`shellrl experiment concurrency|long-tail|staleness`),
each on the real stack (cli/launcher.py: Redis, engine, sandbox, verifier, rollout, learner).

    workload.py   the experiments: their points (settings that differ), tasks and episode delays
    runner.py     one stack per experiment; per point: restart the services, submit, measure
    measure.py    what a point measured (learner ledger, published episodes) and its summary
    report.py     the table (rich and Markdown), the plots, report.md and results.json

Episode durations come from the tasks' own setup scripts (`sleep`), run by the real sandbox inside
each episode's session, so an episode holds its environment for that long; on the CPU the base
durations (10 s, 80 s) are multiplied by a stated scale. The tiny random model never solves a
task, so every group has zero reward variance: the learner trains them anyway
(SHELLRL_TRAIN_ZERO_VARIANCE_GROUPS), and the experiments measure the system, not learning.
"""
