"""`shardopt.lightning`, the documented path of shardopt.frameworks.lightning (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".frameworks.lightning", __package__)
