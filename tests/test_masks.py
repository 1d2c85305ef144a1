"""The bitfield mask rule against an independent pair-by-pair evaluation."""

import random

import pytest
import torch

from lightning_mm.attention import mask as masks


def rule(wi, wj, i, j, si, sj):
    """The mask rule (lightning_mm.attention.mask's docstring), written out literally for one pair."""
    if wi == 0 or wj == 0 or si != sj:
        return False
    mod = (1 << 61) - 1
    if wi & (1 << 62):
        return (j <= i and (wi & wj & mod) != 0) or (bool(wi & (1 << 61)) and (wi & mod) == (wj & mod))
    return (wi & mod) == (wj & mod)


def random_words(gen: random.Random, n, num_encoders=3):
    choices = [0, masks.text_word(num_encoders)] + [masks.modality_word(k, num_encoders) for k in
                                                     range(1, num_encoders + 1)]
    words = []
    for _ in range(n):
        if gen.random() < 0.3:  # arbitrary words, causal or not
            words.append(gen.getrandbits(num_encoders + 1) | (gen.random() < 0.5) << 62)
        elif gen.random() < 0.2:  # a span word of one of three spans
            words.append(masks.span_word(gen.randrange(1, num_encoders + 1), num_encoders, gen.randrange(1, 4)))
        else:
            words.append(gen.choice(choices))
    return words


@pytest.mark.parametrize("seed", range(5))
def test_to_dense_matches_pairwise_rule(seed):
    gen = random.Random(seed)
    b, s = 2, 23
    words = [random_words(gen, s) for _ in range(b)]
    segs = [[gen.randrange(3) for _ in range(s)] for _ in range(b)]
    dense = masks.to_dense(torch.tensor(words), torch.tensor(segs))
    expected = torch.tensor([[[rule(words[r][i], words[r][j], i, j, segs[r][i], segs[r][j]) for j in range(s)]
                              for i in range(s)] for r in range(b)])
    assert torch.equal(dense, expected)
    nosegs = masks.to_dense(torch.tensor(words))
    expected = torch.tensor([[[rule(words[r][i], words[r][j], i, j, 0, 0) for j in range(s)] for i in range(s)]
                             for r in range(b)])
    assert torch.equal(nosegs, expected)


@pytest.mark.parametrize("layout", masks.LAYOUTS)
@pytest.mark.parametrize("block", [4, 7, 16])
def test_block_workload_counts_key_blocks_with_an_allowed_pair(layout, block):
    bam, seg = masks.random_bam(layout, 61, num_encoders=3, batch=2, seed=block)
    dense = masks.to_dense(bam, seg)
    nb = -(-61 // block)
    padded = torch.nn.functional.pad(dense, (0, nb * block - 61, 0, nb * block - 61))
    expected = padded.view(2, nb, block, nb, block).any(4).any(2).sum(-1)
    assert torch.equal(masks.block_workload(bam, block, seg), expected)


def test_default_words_and_layouts():
    n = 2
    text, vis, aud = masks.text_word(n), masks.modality_word(1, n), masks.modality_word(2, n)
    assert text == masks.CAUSAL | 0b111 and vis == 0b10 and aud == 0b100
    assert masks.modality_word(1, n, causal=True) == text
    mods = masks.layout_ep([(1, 2), (2, 1)], 3)
    assert mods.tolist() == [1, 1, 2, 0, 0, 0]
    dense = masks.to_dense(masks.words_from_modalities(mods[None], n))[0]
    assert dense[0].tolist() == [True, True, False, False, False, False]  # image tokens see their image only
    assert dense[5].tolist() == [True] * 6  # text sees everything before it
    assert dense[3].tolist() == [True, True, True, True, False, False]
    mods, segs = masks.layout_mp([torch.tensor([1, 0]), torch.tensor([0, 0])], 6)
    dense = masks.to_dense(masks.words_from_modalities(mods[None], n), segs[None])[0]
    assert dense[2].tolist() == [False, False, True, False, False, False]  # new segment starts fresh
    assert not dense[4:].any()  # padding rows and columns are empty
    assert segs.dtype == torch.int16 and segs.tolist() == [0, 0, 1, 1, 2, 2]


def test_segment_ids_take_the_narrowest_dtype_that_holds_them():
    assert masks.segment_dtype(0) == masks.segment_dtype(32767) == torch.int16  # ids 0..32767 incl. padding
    assert masks.segment_dtype(32768) == torch.int32
    many = [torch.tensor([0])] * 40000  # 40k one-token samples: ids up to 40000 need int32
    _, segs = masks.layout_mp(many, 40001)
    assert segs.dtype == torch.int32 and segs[-2:].tolist() == [39999, 40000]


def test_validation_errors():
    with pytest.raises(ValueError, match="bit 63"):
        masks.validate(torch.tensor([[-(1 << 63) | 1]]))
    with pytest.raises(ValueError, match="62 encoders do not fit"):
        masks.text_word(62)
    with pytest.raises(ValueError, match="segment_ids has shape"):
        masks.to_dense(torch.ones(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="int64"):
        masks.validate(torch.ones(1, 4, dtype=torch.int32))


def test_span_words_see_their_own_item_both_ways_and_earlier_tokens():
    """Gemma 3's images: each run of modality tokens its own span; a span token sees every earlier token and the
    later tokens of its own run, text stays causal; HF's ``token_type_ids`` groups written out."""
    mods = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, -1]])  # text, image A (2), text, image B (3), text, padding
    assert masks.item_spans(mods).tolist() == [[0, 1, 1, 0, 2, 2, 2, 0, 0]]
    bam = masks.words_from_modalities(mods, 1, spans=True)
    dense = masks.to_dense(bam)[0]
    group = [0, 1, 1, 0, 2, 2, 2, 0, 0]
    for i in range(8):
        for j in range(8):
            expected = j <= i or (group[i] > 0 and group[i] == group[j])
            assert bool(dense[i, j]) == expected, (i, j)
    assert not dense[8].any() and not dense[:, 8].any()
    assert masks.to_dense(bam, window=2)[0, 1, 2] and not masks.to_dense(bam, window=2)[0, 4, 1]  # AND the window
    with pytest.raises(ValueError, match="room for 3 spans"):
        masks.span_word(1, 58, 4)
