"""The example GPT, its data, its training helpers and the result files, as one importable package: the
training scripts (integrations/fsdp/train.py, integrations/deepspeed/train.py, launch/bench/train_ddp.py),
the benchmarks (launch/bench/) and launch/results_table.py import them as `integrations.<module>`.

It is a package of this project (pyproject.toml), so a checkout's editable install (launch/env.sh,
`pip install -e .`) makes it importable from every script, wherever the script lives; a process
started with the checkout on PYTHONPATH (as the benchmarks and tests start theirs) finds it there."""
