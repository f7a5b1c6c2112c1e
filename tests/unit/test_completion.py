import pytest

from forge.data import Completion


def test_policy_version_is_the_oldest_token_version():
    c = Completion([1], [5, 6, 7], "abc", [-0.1, -0.2, -0.3], [3, 3, 4], "length")
    assert c.policy_version == 3
    assert Completion([1], [], "", [], [], "abort").policy_version is None


def test_lengths_must_match():
    with pytest.raises(ValueError, match="3 tokens, 2 logprobs, 3 versions: they must match"):
        Completion([1], [5, 6, 7], "abc", [-0.1, -0.2], [3, 3, 4], "length")
