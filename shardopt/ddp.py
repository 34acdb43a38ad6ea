"""`shardopt.ddp`, the documented path of shardopt.frameworks.ddp (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".frameworks.ddp", __package__)
