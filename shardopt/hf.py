"""`shardopt.hf`, the documented path of shardopt.frameworks.hf (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".frameworks.hf", __package__)
