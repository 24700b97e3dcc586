from __future__ import annotations


def test_bundled_multihop_sample(multihop) -> None:
    assert len(multihop.chunks) == 1_704 and len(multihop.queries) == 2_556
    query = multihop.queries[0]
    blocks = multihop.blocks_for(query)
    assert [b.id for b in blocks] == list(query.retrieved)
    assert all(b.tokens and b.tokens <= 1_024 for b in blocks)
    assert blocks[0].metadata["source"]
