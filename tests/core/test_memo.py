"""The package's one cache (`hf_attnscale.core.call.memo`): what it serves, to whom, and what it keeps alive."""

import gc
import weakref

import torch

from hf_attnscale.core.call import memo


def test_a_forwards_later_layers_read_what_its_first_made_and_another_forward_makes_it_again():
    positions, made = torch.arange(5)[None], []

    def make():
        made.append(1)
        return len(made)

    def ask(layer, tensors=(positions, None), static=("test",)):
        return memo.shared_by_layers(layer, static, tensors, make)

    assert [ask(0), ask(1), ask(2)] == [1, 1, 1]  # one forward: made once
    assert ask(0) == 2  # layer 0 again: a new forward
    assert ask(1, tensors=(positions.clone(), None)) == 3  # an equal tensor is another tensor
    assert ask(2, static=("other",)) == 4  # another key
    assert ask(None) == 5 and ask(None) == 6  # a layer with no index: made for it alone


def test_the_tensors_are_held_weakly():
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool)
    held = weakref.ref(mask)
    assert memo.shared_by_layers(0, ("weak",), (None, mask), lambda: True)
    del mask
    gc.collect()
    assert held() is None, "the cache kept a mask the caller had let go of"
