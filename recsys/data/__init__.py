"""Data loading: the Batch type and the readers that produce it."""

from recsys.data.batch import Batch
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo

__all__ = ["Batch", "SyntheticConfig", "SyntheticCriteo"]
