"""`shardopt.accelerate`, the documented path of shardopt.frameworks.accelerate (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".frameworks.accelerate", __package__)
