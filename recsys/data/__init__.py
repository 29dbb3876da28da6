"""Data loading: the Batch type, the Dataset protocol and the readers that produce batches."""

from recsys.data.batch import Batch
from recsys.data.source import DataConfig, Dataset, build_dataset
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo

__all__ = ["Batch", "DataConfig", "Dataset", "SyntheticConfig", "SyntheticCriteo", "build_dataset"]
