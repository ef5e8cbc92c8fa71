"""PrintableText: gymnasium's Text over the printable characters, its character tables built
once and shared by every instance and copy (bunshin_gym.core.spaces)."""

from __future__ import annotations

import copy
import pickle

import gymnasium as gym
import pytest
from gymnasium import spaces
from gymnasium.vector.utils import batch_space

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.core.spaces import PRINTABLE, PrintableText
from bunshin_gym.serve import codec


def test_it_is_the_text_space_of_its_charset():
    space = PrintableText(16, min_length=0, controls="\n\t\r")
    plain = spaces.Text(16, min_length=0, charset=PRINTABLE + "\n\t\r")
    assert space == plain and space.character_set == plain.character_set
    assert space.contains("héllo wörld\r\n") and space.contains("")
    assert not space.contains("\x00") and not space.contains("x" * 17)
    assert not PrintableText(16).contains("")  # min_length 1 by default, as Text's
    assert not PrintableText(16).contains("a\rb")  # "\r" only where the family carries it
    sample = space.sample()
    assert len(sample) <= 16 and space.contains(sample)


@pytest.mark.parametrize("min_length", [5, -1])
def test_lengths_are_checked_as_gymnasium_checks_them(min_length):
    with pytest.raises(ValueError):
        PrintableText(4, min_length=min_length)


def test_copies_share_the_tables_and_own_their_generator():
    space = PrintableText(64)
    space.seed(1)
    twin = copy.deepcopy(space)
    assert twin == space and twin._char_index is space._char_index and twin._char_list is space._char_list
    assert twin.np_random is not space.np_random
    assert twin.sample() == space.sample()  # the same state copied ...
    twin.seed(2)
    space.seed(1)
    assert space.sample() == PrintableText(64, seed=1).sample()  # ... and each one's own


def test_pickle_and_the_service_codec_keep_the_space():
    space = PrintableText(100, min_length=0, controls="\n\t\r")
    back = pickle.loads(pickle.dumps(space))
    assert back == space and back.controls == space.controls and back._char_index is space._char_index
    desc = codec.space_to_json(space)
    assert len(str(desc)) < 200  # its arguments travel, not its characters
    assert codec.space_from_json(desc) == space


def test_a_group_batches_its_text_fields_sharing_the_tables():
    envs = gym.make_vec("Bunshin-Shell-v0", num_envs=4, vectorization_mode="vector_entry_point")
    try:
        batched = envs.observation_space
        assert batched is envs.observation_space  # made once, when first asked for
        assert batched == batch_space(envs.single_observation_space, 4)
        outputs = list(batched["output"])  # a Tuple: one text space per member
        assert len(outputs) == 4
        assert all(o._char_index is outputs[0]._char_index for o in outputs)
        assert envs.action_space == batch_space(envs.single_action_space, 4)
    finally:
        envs.close()
