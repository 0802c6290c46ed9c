"""What the tests share: every helper module of the suite lives here, imported as `tests.support.X`
(the repository root is on sys.path: pyproject's `pythonpath = ["."]`; a spawned gloo rank inherits it,
and subprocesses run with `cwd` or PYTHONPATH at the root). Test folders hold only test_*.py, their
conftest.py and data; fixtures several folders use are in tests/conftest.py.

    dist              run_distributed: a function on N spawned gloo ranks (tp, plans, fill, quant, trainer)
    live              a real `reshard serve`, small checkpoints, flaky proxies, /metrics reads
    hard              the hardening suite's variants: two workers, verbose logs, a throttling proxy
    fs                small real file systems (ext4 image, tmpfs) to fill and remount read-only
    core              hand-built safetensors bytes, torch references of every split, in-process CLI runs
    plan_reference    a digest of everything a plan determines, and the reference planner it checks
    plan_archs        the architectures the plan tests build, and what they compare
    nd                transformers' own TP and n-D loads on the ranks (the plan and layout tests' reference)
    trainer_archs     tiny checkpoints of the trainer's architectures, and rules to shard them
    trainer_checks    the trainer tests' jobs on the ranks, and torchrun training runs
    fill_checks       the fill_model tests' jobs on the ranks
    tp_checks         the TP ops' and layers' checks on the ranks (tp_checks_ops, tp_checks_layers)
    fp8_ckpt          FP8 checkpoints as their producers make them, and the dequantizing reference
"""
