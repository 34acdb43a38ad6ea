"""`shardopt.torchtitan`, the documented path of shardopt.frameworks.torchtitan (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".frameworks.torchtitan", __package__)
