from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.index import PrefixTrie, greedy_plan

batches = st.lists(st.lists(st.integers(0, 30), min_size=0, max_size=10, unique=True), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_orders_are_permutations_and_schedule_covers_the_batch(batch: list[list[int]]) -> None:
    plan = greedy_plan(batch)
    assert sorted(plan.schedule) == list(range(len(batch)))
    for request, order in zip(batch, plan.orders, strict=True):
        assert sorted(order) == list(range(len(request)))


def test_shared_blocks_form_a_common_prefix() -> None:
    batch = [["x", "a", "b"], ["b", "y", "a"], ["a", "z", "b"], ["q", "r"]]
    plan = greedy_plan(batch)
    orders = [[request[i] for i in order] for request, order in zip(batch, plan.orders, strict=True)]
    for order in orders[:3]:
        assert set(order[:2]) == {"a", "b"} and order[:2] == orders[0][:2]
    assert plan.schedule[-1] == 3  # the request sharing nothing goes last


def test_beats_retrieval_order_on_multihop(multihop) -> None:
    batch = [list(q.retrieved) for q in multihop.queries]
    plan = greedy_plan(batch)

    def reused(orders: list[list[str]], schedule: list[int]) -> int:
        trie: PrefixTrie[str] = PrefixTrie()
        return sum(trie.insert(str(i), orders[i]) for i in schedule)

    ours = reused([[r[i] for i in o] for r, o in zip(batch, plan.orders, strict=True)], plan.schedule)
    baseline = reused(batch, list(range(len(batch))))
    assert ours > 2 * baseline
