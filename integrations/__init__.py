"""The example GPT, its data, its training helpers and the result files, as one importable package: the
training scripts (integrations/fsdp/train.py, integrations/deepspeed/train.py, launch/bench/train_ddp.py),
the benchmarks (launch/bench/) and launch/results_table.py import them as `integrations.<module>`.

It is a package of the checkout, not of the installed library (the wheel ships shardopt only): launch/env.sh
puts the checkout on the environment's path (a .pth file beside the editable install), so it is importable
from every script, wherever the script lives; without env.sh, run the scripts with PYTHONPATH=<checkout>."""
