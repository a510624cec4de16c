"""RLHF algorithms, one file each: grpo.py, grpo_multiturn.py, ppo.py, dpo.py, online_dpo.py (or
your own module).

`runtime.algorithm.name` in the main YAML picks one: a name here (`grpo`), or the dotted path of
your own module (`my_pkg.my_algo`, importable from the directory you run in). An algorithm module
declares everything about itself; nothing else in chatgen lists algorithms:

    Config      a dataclass subclassing chatgen.rlhf.schema.AlgorithmConfig: its own keys of the `runtime.algorithm:`
                section, each `name: type = opt(default, "doc")`, with a `check()` for ranges (typed, typo-checked
                and documented like every other config section)
    MODELS      {model name: chatgen.rlhf.schema.Role(backend, trainable=..., optional=..., syncs_to=...)}: the models
                it needs; the config is checked against it before anything starts
    check(cfg)  optional: yields "key: problem; fix" strings for rules across models and sections
    trainer_rows(cfg) -> int   optional: rows each trainer call of an episode gets, when not sample_per_episode
                (Online DPO: one pair per prompt); the batch-size checks count these
    train(cfg, resume=False, log=print) -> dict   the episode loop, top to bottom (chatgen.rlhf.run.Run
                gives it data, generation, scoring, trainer calls, sync, checkpoints, eval and logging)

chatgen.rlhf.registry finds them (`load`, `available`); this package imports nothing, so the
algorithms can import chatgen.rlhf.config and chatgen.rlhf.run without an arrow pointing back up.
docs/extending.md walks through adding one.
"""
