import math

import pytest
import torch

from vlkv.eval.metrics import (
    cache_hit_rate,
    kl_divergence,
    lcs_length,
    perplexity,
    rouge_l_f1,
    rouge_l_f1_text,
    rouge_tokenize,
    token_nll,
    top1_agreement,
)

# Per-dtype tolerances for metrics computed from low-precision logits vs a float64 reference.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


def test_perplexity_is_exp_of_token_mean_not_sample_mean():
    ln2 = math.log(2)
    assert perplexity(torch.tensor([ln2, 3 * ln2])) == pytest.approx(4.0)
    # Samples of 1 and 2 tokens: token mean 2*ln2 -> 4; a per-sample mean would give 2**1.75.
    samples = [torch.tensor([ln2]), torch.tensor([3 * ln2, 2 * ln2])]
    assert perplexity(samples) == pytest.approx(4.0)
    assert perplexity(samples) != pytest.approx(2**1.75)


def test_perplexity_rejects_empty_and_2d():
    with pytest.raises(ValueError, match="nll"):
        perplexity(torch.empty(0))
    with pytest.raises(ValueError, match="nll"):
        perplexity(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="nll"):
        perplexity([])


def test_token_nll_hand_values():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e9, -1e9]])
    nll = token_nll(logits, torch.tensor([2, 1]))
    torch.testing.assert_close(nll, torch.tensor([math.log(4), math.log(4 / 3)]), rtol=1e-6, atol=1e-6)
    assert nll.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 9, 81])
def test_token_nll_matches_float64_reference(dtype, t):
    g = torch.Generator().manual_seed(t)
    logits = (torch.randn(t, 37, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 37, (t,), generator=g)
    ref = -torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(token_nll(logits, targets).double(), ref, **TOL[torch.float32])


def test_token_nll_shape_errors():
    with pytest.raises(ValueError, match="logits"):
        token_nll(torch.zeros(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        token_nll(torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))


def test_kl_identical_is_zero_and_known_pair():
    p = torch.randn(5, 11, dtype=torch.float32)
    torch.testing.assert_close(kl_divergence(p, p), torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-12)
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3).
    # float64 inputs: ln 3 rounded to float32 would already move the KL by ~1e-8.
    f64 = dict(dtype=torch.float64)
    kl = kl_divergence(torch.tensor([[0.0, 0.0]], **f64), torch.tensor([[0.0, math.log(3)]], **f64))
    assert kl.dtype == torch.float64
    assert kl.item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    # Reverse direction differs: KL is not symmetric.
    rev = kl_divergence(torch.tensor([[0.0, math.log(3)]], **f64), torch.tensor([[0.0, 0.0]], **f64))
    assert rev.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-12)


def test_kl_handles_masked_tokens():
    inf = float("inf")
    # P puts no mass on token 1, so its -inf logit must contribute 0, not nan.
    kl = kl_divergence(torch.tensor([[0.0, -inf]]), torch.tensor([[0.0, 0.0]]))
    assert kl.item() == pytest.approx(math.log(2))
    # Q gives zero mass where P has mass: infinite divergence.
    assert kl_divergence(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -inf]])).item() == inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kl_matches_torch_kl_div(dtype):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(9, 50, generator=g).to(dtype)
    q = (p.float() + 0.3 * torch.randn(9, 50, generator=g)).to(dtype)
    ref = torch.nn.functional.kl_div(
        torch.log_softmax(q.double(), -1),
        torch.log_softmax(p.double(), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    torch.testing.assert_close(kl_divergence(p, q), ref, rtol=1e-10, atol=1e-12)
    assert (kl_divergence(p, q) > 0).all()


def test_top1_agreement():
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 3.0], [5.0, 4.0, 0.0]])
    q = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 1.0], [3.0, 4.0, 0.0]])
    assert top1_agreement(p, q) == pytest.approx(0.5)
    assert top1_agreement(p, p) == 1.0
    with pytest.raises(ValueError, match="q_logits"):
        top1_agreement(p, q[:2])


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("ABCBDAB", "BDCABA", 4),
        ("", "abc", 0),
        ("abc", "abc", 3),
        ("abc", "def", 0),
        ("AGGTAB", "GXTXAYB", 4),
    ],
)
def test_lcs_length_examples(a, b, expected):
    assert lcs_length(list(a), list(b)) == expected
    assert lcs_length(list(b), list(a)) == expected


def test_rouge_l_hand_example():
    # LCS(a b c d, a c e) = 2 -> P = 1/2, R = 2/3, F = 4/7.
    assert rouge_l_f1(["a", "b", "c", "d"], ["a", "c", "e"]) == pytest.approx(4 / 7)
    assert rouge_l_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l_f1([], [1]) == 0.0
    assert rouge_l_f1([1], [2]) == 0.0


SENTENCE_PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting on the mat!"),
    (
        "A red bus drives down a busy street in London.",
        "The image shows a red double-decker bus on a street.",
    ),
    ("Two dogs play in the snow near a wooden fence", "two DOGS are playing in snow, next to a fence."),
    ("There is no text in this image.", "The sign reads 'OPEN 24/7' in white letters."),
    ("identical sentence here", "identical sentence here"),
    ("", "non-empty reference"),
    ("!!! ???", "punctuation only candidate"),
    ("Numbers 3.14 and 42 appear; 42 twice: 42.", "42 and 3 14 numbers"),
]


@pytest.mark.parametrize(("cand", "ref"), SENTENCE_PAIRS)
def test_rouge_l_text_matches_rouge_score(cand, ref):
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer", reason="rouge-score is in the eval extra")
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    expected = scorer.score(ref, cand)["rougeL"].fmeasure
    assert rouge_l_f1_text(cand, ref) == pytest.approx(expected, abs=1e-12)


def test_rouge_l_on_token_ids_matches_rouge_score():
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer", reason="rouge-score is in the eval extra")
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    g = torch.Generator().manual_seed(0)
    for n, m in [(1, 9), (9, 9), (30, 81), (81, 30)]:
        a = torch.randint(0, 6, (n,), generator=g).tolist()
        b = torch.randint(0, 6, (m,), generator=g).tolist()
        expected = scorer.score(" ".join(f"t{x}" for x in b), " ".join(f"t{x}" for x in a))["rougeL"].fmeasure
        assert rouge_l_f1(a, b) == pytest.approx(expected, abs=1e-12)


def test_rouge_tokenize():
    assert rouge_tokenize("Hello, World! It's 3.5-ish") == ["hello", "world", "it", "s", "3", "5", "ish"]


def test_cache_hit_rate_hand_example():
    scores = torch.tensor([0.1, 0.5, 0.3, 0.05, 0.05])
    assert cache_hit_rate(torch.tensor([1, 3]), scores, k=2) == pytest.approx(0.5)
    assert cache_hit_rate(torch.tensor([2, 1]), scores, k=2) == 1.0
    assert cache_hit_rate(torch.tensor([0, 4]), scores, k=2) == 0.0
    # Ties at the k-th score go to the lower position: top-2 of (1, 1, 1, 0) is {0, 1}.
    assert cache_hit_rate(torch.tensor([0, 2]), torch.tensor([1.0, 1.0, 1.0, 0.0]), k=2) == pytest.approx(0.5)


def test_cache_hit_rate_rows_padding_and_duplicates():
    # (layers=2, heads=2, n=4); row means: 1, 0.5, 0 (padding -1 ignored), 0.5 (duplicate counted once).
    scores = torch.tensor([[[4.0, 3, 2, 1], [1, 2, 3, 4]], [[0, 0, 5, 6], [9, 0, 8, 0]]])
    kept = torch.tensor([[[0, 1], [3, 0]], [[-1, 0], [0, 0]]])
    assert cache_hit_rate(kept, scores, k=2) == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)


def test_cache_hit_rate_errors():
    with pytest.raises(ValueError, match="k must be"):
        cache_hit_rate(torch.tensor([0]), torch.ones(3), k=4)
    with pytest.raises(ValueError, match="leading dims"):
        cache_hit_rate(torch.zeros(2, 1, dtype=torch.long), torch.ones(3, 4), k=1)
    with pytest.raises(ValueError, match="kept_indices must be < n"):
        cache_hit_rate(torch.tensor([5]), torch.ones(3), k=1)
