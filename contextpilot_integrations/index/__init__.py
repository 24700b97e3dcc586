"""The context index: what the engine holds, and how to order requests against it."""

from .cluster import ClusterTree
from .distance import condensed_distances, context_distance
from .greedy import greedy_plan
from .prefix_trie import PrefixTrie
from .strategies import STRATEGIES, PaperStrategy, RetrievalOrder, Strategy, TrieStrategy, make_strategy

__all__ = [
    "STRATEGIES",
    "ClusterTree",
    "PaperStrategy",
    "PrefixTrie",
    "RetrievalOrder",
    "Strategy",
    "TrieStrategy",
    "condensed_distances",
    "context_distance",
    "greedy_plan",
    "make_strategy",
]
