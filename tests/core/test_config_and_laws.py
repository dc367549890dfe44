"""`AttnScaleConfig` (its defaults, validation and round trip) and the scale laws against their closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnscale.core.options.config import SCALES, AttnScaleConfig, read_saved_config
from hf_attnscale.core.options.laws import query_multiplier, ssmax_init


def test_clamp_defaults_by_scale():
    assert AttnScaleConfig("logn", 512).clamp is True
    assert AttnScaleConfig("gradmax", 512).clamp is True
    assert AttnScaleConfig("ssmax", 512).clamp is False
    assert AttnScaleConfig().is_identity and not AttnScaleConfig(zero_kv=True).is_identity


def test_exit_settings():
    assert AttnScaleConfig(zero_kv=True).fixed_sink_logit == 0.0
    assert AttnScaleConfig(sink_logit=2).fixed_sink_logit == 2.0  # an int is taken as a float
    learnable = AttnScaleConfig(sink_logit="learnable")
    assert learnable.has_exit and learnable.fixed_sink_logit is None
    assert AttnScaleConfig.from_options(scale=None, zero_kv=None) is None


def test_round_trip_and_unknown_keys():
    config = AttnScaleConfig("ssmax", 256, zero_kv=True)
    assert AttnScaleConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"Unknown attn_scale config keys \['scael'\]"):
        AttnScaleConfig.from_dict({"scael": "logn"})

    class Saved:
        hf_attnscale = config.to_dict()

    assert read_saved_config(Saved()) == config


def test_error_lists_every_scale():
    with pytest.raises(ValueError) as error:
        AttnScaleConfig("cube", 512)
    assert all(repr(name) in str(error.value) for name in SCALES)


def _n(*values: float) -> torch.Tensor:
    return torch.tensor(values).view(1, 1, -1)


def test_logn_is_log_base_train_length():
    config = AttnScaleConfig("logn", 64, clamp=False)
    got = query_multiplier(config, _n(8, 64, 4096, 0)).flatten().tolist()
    assert got == pytest.approx([0.5, 1.0, 2.0, 0.0])  # n < 1 (a fully masked row) counts as 1
    clamped = query_multiplier(AttnScaleConfig("logn", 64), _n(8, 64, 4096)).flatten().tolist()
    assert clamped == pytest.approx([1.0, 1.0, 2.0])


def test_gradmax_is_the_square_root_of_logn():
    got = query_multiplier(AttnScaleConfig("gradmax", 64), _n(8, 4096, 64**4)).flatten().tolist()
    assert got == pytest.approx([1.0, math.sqrt(2.0), 2.0])


def test_ssmax_starts_at_logn_and_is_per_head():
    config = AttnScaleConfig("ssmax", 100)
    slopes = torch.tensor([ssmax_init(100), 2 * ssmax_init(100)])
    got = query_multiplier(config, _n(10, 1000), slopes)
    assert got.shape == (1, 2, 2)
    assert got.flatten().tolist() == pytest.approx([0.5, 1.5, 1.0, 3.0])


def test_no_multiplier_without_a_scale():
    with pytest.raises(ValueError, match="No multiplier for scale='none'"):
        query_multiplier(AttnScaleConfig(), _n(4))
