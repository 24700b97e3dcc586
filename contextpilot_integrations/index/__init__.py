"""The context index: what the engine holds, and how to order requests against it."""

from .agglomerate import agglomerate
from .cluster import ClusterTree
from .distance import condensed_distances, context_distance
from .greedy import BatchPlan, greedy_plan
from .prefix_trie import PrefixTrie
from .strategies import STRATEGIES, LiveView, PaperStrategy, RetrievalOrder, Strategy, TrieStrategy, make_strategy

__all__ = [
    "STRATEGIES",
    "BatchPlan",
    "ClusterTree",
    "LiveView",
    "PaperStrategy",
    "PrefixTrie",
    "RetrievalOrder",
    "Strategy",
    "TrieStrategy",
    "agglomerate",
    "condensed_distances",
    "context_distance",
    "greedy_plan",
    "make_strategy",
]
