"""Spec: the controller's PrefixRouter (actors/prefix_routing.py) names the replica that served
the longest recorded start of a prompt and how many of the prompt's tokens (all but the last)
that replica's prefix cache should hold; text prompts by their characters; a rebuilt replica's
entries and everything after a clear no longer count. The controller's use of it (a next turn
finding its KV cached on the replica that served it) is in test_controller."""
from actors.prefix_routing import PrefixRouter


def test_the_deepest_recorded_token_names_the_replica():
    router = PrefixRouter()
    assert router.match([1, 2, 3]) == (-1, 0)
    router.record([1, 2, 3], [4, 5], replica=0)  # a conversation's turn on replica 0
    router.record([1, 2, 9], [7], replica=1)  # same system prompt, another conversation
    assert router.match([1, 2, 3, 4, 5, 6, 7]) == (0, 5)
    assert router.match([1, 2, 9, 7, 8]) == (1, 4)
    assert router.match([1, 2, 3]) == (0, 2)  # the last token is always computed
    assert router.match([1, 2, 8, 8]) == (0, 2)  # the shared start, first served by 0
    assert router.match([5, 1, 2]) == (-1, 0)


def test_text_prompts_match_by_characters():
    router = PrefixRouter()
    router.record("You are helpful. Q: 2+2?", " 4.", replica=1)
    assert router.match("You are helpful. Q: 2+2? 4. Q: 3+3?") == (1, len("You are helpful. Q: 2+2? 4."))
    assert router.match("Hé, you") == (-1, 0)


def test_forgotten_replicas_and_clears_count_for_nothing():
    router = PrefixRouter()
    router.record([1, 2, 3], [4], replica=0)
    router.record([5, 6], [7], replica=1)
    router.forget_replica(0)  # rebuilt: an empty cache
    assert router.match([1, 2, 3, 4, 9]) == (-1, 0)
    router.record([1, 2, 3], [8], replica=0)  # served again after the rebuild
    assert router.match([1, 2, 3, 8, 9]) == (0, 4)
    assert router.match([5, 6, 7, 1]) == (1, 3)
    router.clear()
    assert router.match([5, 6, 7, 1]) == (-1, 0)


def test_the_tree_stays_within_its_bound_dropping_the_least_recent():
    router = PrefixRouter(max_tokens=20)
    for i in range(10):
        router.record([100 + i, 1, 2, 3], [4], replica=i % 2)
    assert router._tree.num_tokens <= 20
    assert router.match([109, 1, 2, 3, 4, 5]) == (1, 5)  # the latest are kept
    assert router.match([100, 1, 2, 3, 4, 5]) == (-1, 0)
