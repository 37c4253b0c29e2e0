"""Proposers: prompt lookup (n-gram index) and the session suffix tree."""
import random

import pytest

from engine.spec.ngram import NgramIndex
from engine.spec.suffix import SuffixTree


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: longest suffix n-gram with an earlier occurrence; continue after its latest one."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_prompt_lookup_proposes_what_followed_the_repeated_ngram():
    index = NgramIndex(min_n=2, max_n=3, tokens=[5, 6, 7, 8, 9, 1, 6, 7])
    assert index.propose(3) == [8, 9, 1]  # "6 7" occurred before, followed by 8 9 1
    index.extend([8])
    assert index.propose(2) == [9, 1]  # now "6 7 8" matches (longer n wins)
    index.extend([4])
    assert index.propose(3) == []  # "8 4" never occurred
    assert index.propose(0) == []


def test_prompt_lookup_prefers_the_latest_occurrence_and_repeats():
    index = NgramIndex(min_n=1, max_n=2, tokens=[1, 2, 3, 1, 2, 4, 1, 2])
    assert index.propose(2) == [4, 1]  # latest earlier "1 2" is followed by 4
    periodic = NgramIndex(min_n=2, max_n=2, tokens=[7, 8, 7, 8])
    assert periodic.propose(4) == [7, 8]  # the continuation runs into the suffix itself


@pytest.mark.parametrize("seed", range(5))
def test_prompt_lookup_matches_brute_force_as_tokens_are_appended(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(40)]
    index = NgramIndex(min_n=2, max_n=4, tokens=tokens[:10])
    for i in range(10, len(tokens)):
        assert index.propose(3) == brute_force_lookup(tokens[:i], 3, 2, 4), i
        index.extend([tokens[i]])
    index.truncate(25)
    assert index.tokens == tokens[:25] and index.propose(3) == brute_force_lookup(tokens[:25], 3, 2, 4)


def test_prompt_lookup_rejects_bad_ranges():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=3, max_n=2)


def test_suffix_tree_follows_the_most_frequent_continuation():
    tree = SuffixTree(max_depth=8)
    tree.add([1, 2, 3, 4, 5])
    tree.add([9, 2, 3, 4, 6])
    tree.add([8, 2, 3, 4, 6, 7])
    assert tree.propose([0, 2, 3], 3) == [4, 6, 7]  # after "2 3 4", 6 was seen twice and 5 once
    assert tree.propose([0, 1, 2, 3], 2) == [4, 5]  # the longer match "1 2 3" decides
    assert tree.propose([0, 0, 0], 3) == []
    assert tree.propose([7], 3) == []  # a one-token match is below min_match


def test_suffix_tree_leaves_room_for_k_tokens_below_the_match():
    tree = SuffixTree(max_depth=4, min_match=1)
    tree.add([1, 2, 3, 4, 5, 6])
    # max_depth - k = 2: the context's last two tokens are matched, so two tokens of continuation fit.
    assert tree.propose([9, 2, 3], 2) == [4, 5]
    assert tree.propose([1, 2, 3], 3) == [4, 5, 6]  # k = 3 leaves room for a one-token match ("3") only


def test_suffix_tree_forgets_the_oldest_documents_exactly():
    tree = SuffixTree(max_depth=6, max_documents=2)
    tree.add([1, 2, 3, 4])
    nodes_one = tree.num_nodes
    tree.add([5, 2, 3, 7])
    assert tree.propose([2, 3], 1) in ([4], [7])
    tree.add([1, 2, 3, 4])  # the first document is forgotten, then added again: counts stay consistent
    assert tree.num_documents == 2
    tree.add([6, 6, 6])
    tree.add([6, 6, 6])  # both older documents gone: only "6 6 6" suffixes remain
    assert tree.propose([1, 2], 2) == []
    assert tree.propose([6, 6], 1) == [6]
    fresh = SuffixTree(max_depth=6)
    fresh.add([6, 6, 6])
    assert tree.num_nodes == fresh.num_nodes == 3 and nodes_one == 10
