"""shardopt: communication-efficient matrix optimizers (Dion, Sign-Muon) for distributed PyTorch."""

__version__ = "0.1.0"

from .groups import describe_groups, param_groups
from .guard import DoubleAveragingError
from .localsteps import LocalSteps
from .optimizer import Dion, ShardOptimizer, SignMuon
from .polar import polar
from .vote import VOTE_FORMATS, vote_bytes

__all__ = ["Dion", "SignMuon", "ShardOptimizer", "LocalSteps", "DoubleAveragingError", "param_groups", "describe_groups", "polar",
           "VOTE_FORMATS", "vote_bytes", "__version__"]
