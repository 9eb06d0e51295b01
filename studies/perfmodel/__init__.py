"""A performance model of pipeline × data × tensor parallel training (GPT and Llama-family
models, every DP sharding mode): step time, MFU and memory per GPU.

Plain Python (no torch), so a plan can be made anywhere. ``predict`` prices one layout on a
cluster spec (``load_cluster``); ``search`` ranks every layout that fits and divides, and
says why the others do not. See docs/PERFMODEL.md for the formulas and their validation.
"""

from studies.perfmodel.cluster_spec import ClusterSpec, load_cluster
from studies.perfmodel.model import Layout, Prediction, Workload, predict
from studies.perfmodel.search import SearchResult, search

__all__ = [
    "ClusterSpec",
    "Layout",
    "Prediction",
    "SearchResult",
    "Workload",
    "load_cluster",
    "predict",
    "search",
]
