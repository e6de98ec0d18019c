"""The MTP draft's vocabulary (`speculative_config.draft_vocab_size`, engine/rank/speculative.py):
the pick among the first N ids over a vocabulary-sharded lm_head (engine/rank/embedding.py),
against the argmax of the full logits cut to N columns, with the shards of 1, 2 and 4 ranks
laid out as VocabParallelEmbedding lays them; the config's refusals by name."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.rank.embedding import best_of, shard_best
from deltaserve.engine.speculative_config import SpeculativeConfig, parse_speculative_config

VOCAB = 96
HIDDEN = 16


def sharded_argmax(hidden: torch.Tensor, weight: torch.Tensor, rows: int, ranks: int) -> list:
    """What every rank gets from `VocabParallelEmbedding.argmax`: each rank's `shard_best` of
    its vocab_size / ranks rows, stacked as the all-gather stacks them."""
    width = weight.shape[0] // ranks
    parts = [
        shard_best(hidden, weight[r * width : (r + 1) * width], r * width, rows)
        for r in range(ranks)
    ]
    return best_of(torch.stack(parts)).tolist()


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 5, 24, 30, 48, 95, VOCAB])
def test_the_pick_is_the_argmax_over_the_first_rows(ranks, rows):
    gen = torch.Generator().manual_seed(rows * 10 + ranks)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    hidden = torch.randn(7, HIDDEN, generator=gen)
    want = (hidden @ weight.t())[:, :rows].argmax(dim=-1).tolist()
    got = sharded_argmax(hidden, weight, rows, ranks)
    assert got == want
    assert all(0 <= token < rows for token in got)


def test_a_tie_across_shards_picks_the_lowest_id():
    """As an argmax over the whole row: the shards must agree with the unsharded pick."""
    weight = torch.zeros(VOCAB, HIDDEN)
    weight[10, 0] = weight[60, 0] = weight[80, 0] = 1.0  # ids 10, 60 and 80 tie
    hidden = torch.zeros(2, HIDDEN)
    hidden[:, 0] = 1.0
    assert sharded_argmax(hidden, weight, VOCAB, 4) == [10, 10]
    assert sharded_argmax(hidden, weight, 70, 2) == [10, 10]
    weight[10, 0] = 0.0
    assert sharded_argmax(hidden, weight, 70, 4) == [60, 60]  # 80 is not a draft's


def test_draft_vocab_size_is_refused_by_name():
    config = parse_speculative_config('{"method": "mtp", "draft_vocab_size": 32000}')
    assert config.draft_vocab(248320) == 32000
    assert SpeculativeConfig().draft_vocab(248320) == 248320  # None: the whole vocabulary
    for bad in ("0", "-3", "1.5", "true", '"32000"'):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            parse_speculative_config(f'{{"method": "mtp", "draft_vocab_size": {bad}}}')
    with pytest.raises(ValueError, match="draft_vocab_size 248321 is above"):
        SpeculativeConfig(draft_vocab_size=248321).draft_vocab(248320)
