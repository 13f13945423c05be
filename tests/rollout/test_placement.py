"""Where prompts go: a shard with free slots and a free lane, split over shards when needed."""

from knitjax.rollout.placement import place


def test_a_prompt_goes_to_the_shard_with_the_most_room_and_consumes_it():
  slots, lanes = [[0, 1], [2, 3, 4]], [[0], [0]]  # 2 shards, 2 and 3 slots, 1 lane each
  assert place(slots, lanes, [2]) == [[(1, 0, 2)]]  # shard 1 has more room
  assert slots == [[0, 1], [4]] and lanes == [[0], []]  # the lists are consumed
  assert place(slots, lanes, [2]) == [[(0, 0, 2)]]
  assert place(slots, lanes, [1]) is None  # no lane left


def test_a_prompt_larger_than_any_shard_is_split_one_lane_per_shard():
  assert place([[0, 1], [2, 3]], [[0], [0]], [3]) == [[(0, 0, 2), (1, 0, 1)]]
  assert place([[0, 1], [2, 3]], [[0], [0]], [5]) is None
