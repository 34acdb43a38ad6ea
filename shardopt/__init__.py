"""shardopt: communication-efficient matrix optimizers (Dion, Sign-Muon) for distributed PyTorch."""

__version__ = "0.4.0"

from .optim.groups import describe_groups, param_groups
from .optim.guard import DoubleAveragingError
from .localsteps.optimizer import LocalSteps
from .optim.onebit_adam import OneBitAdam
from .optim.optimizer import Dion, ShardOptimizer, SignMuon
from .algorithms.polar import polar
from .wire.vote import VOTE_FORMATS, vote_bytes

__all__ = ["Dion", "SignMuon", "OneBitAdam", "ShardOptimizer", "LocalSteps", "DoubleAveragingError", "param_groups", "describe_groups", "polar",
           "VOTE_FORMATS", "vote_bytes", "__version__"]
