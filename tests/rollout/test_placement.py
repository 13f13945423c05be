"""Where prompts go: the longest prefix that starts now, and the device-side queue's shards."""

from knitjax.rollout.placement import assign, fit


def test_fit_starts_the_longest_prefix_and_leaves_the_rest_untouched():
  slots, lanes = [[0, 1], [2, 3]], [[0], [0]]  # 2 shards, 2 slots and 1 lane each
  shares, left_slots, left_lanes = fit(slots, lanes, [2, 2, 2])
  assert len(shares) == 2  # the third prompt finds no lane
  assert [s[0][0] for s in shares] == [0, 1] and left_slots == [[], []] and left_lanes == [[], []]
  assert slots == [[0, 1], [2, 3]] and lanes == [[0], [0]]  # the caller's lists are not consumed
  # A prompt that does not fit stops the prefix even when a later, smaller one would fit.
  shares, _, _ = fit([[0, 1, 2]], [[0, 1]], [4, 1])
  assert shares == []


def test_assign_spreads_queued_prompts_fewest_first_then_most_room():
  assert assign(0, [1, 2]) == [[], []]
  assert assign(3, [1, 4]) == [[1], [0, 2]]  # shard 1 has more room: it takes the first
  assert assign(4, [2, 2, 2]) == [[0, 3], [1], [2]]
