import pytest

from vlkv.eval.corpus import IMAGE_QA_PROMPTS, image_qa_prompts, paragraphs


def test_corpus_ships_ten_paragraphs_of_100_to_300_words():
    paras = paragraphs()
    assert len(paras) == 10
    for p in paras:
        assert 100 <= len(p.split()) <= 300, p[:60]
        assert p.isascii()
    assert len(set(paras)) == len(paras)


def test_image_qa_prompts():
    assert image_qa_prompts()[0] == "Describe this image in detail."
    assert image_qa_prompts(2) == IMAGE_QA_PROMPTS[:2]
    with pytest.raises(ValueError, match="n must be"):
        image_qa_prompts(0)
