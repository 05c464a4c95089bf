"""Chapter 1's Hugging Face pipeline: it runs on the packaged MiniLM with the network off, and its three stages,
done by hand, give the pipeline's output and the book's own sentence embeddings."""

import socket

import pytest
import torch
import torch.nn.functional as F

from scalebook.embeddings import encode_sentences, mean_pool, minilm_path

SENTENCES = ["The GPU ran out of memory.", "The accelerator had no memory left.", "The cat sat on the mat."]


class NetworkIsOff(OSError):
    pass


@pytest.fixture
def network_off(monkeypatch):
    """Any connection attempt raises, and the Hub client is told it is offline."""

    def refuse(*args, **kwargs):
        raise NetworkIsOff("this test runs with the network off")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def extractor(network_off):
    from transformers import pipeline
    from transformers.utils import logging

    logging.disable_progress_bar()
    return pipeline("feature-extraction", model=str(minilm_path()))


def test_the_network_really_is_off(network_off):
    with pytest.raises(NetworkIsOff):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    with pytest.raises(NetworkIsOff):
        socket.socket().connect(("127.0.0.1", 9))


def test_pipeline_equals_tokenizer_then_model_by_hand(extractor):
    # The same model on the same ids: the hidden states must be identical, not merely close.
    features = extractor(SENTENCES, return_tensors=True)
    for sentence, from_pipeline in zip(SENTENCES, features, strict=True):
        inputs = extractor.tokenizer(sentence, return_tensors="pt")
        with torch.inference_mode():
            hidden = extractor.model(**inputs).last_hidden_state
        assert hidden.shape == (1, inputs["input_ids"].shape[1], 384)
        assert torch.equal(hidden, from_pipeline)


def test_pooled_pipeline_output_equals_the_books_sentence_embeddings(extractor):
    # encode_sentences pads the three sentences into one batch; masked padding changes the real tokens' vectors
    # only by float32 reassociation (~1e-7), so 1e-5 is a safe bound that a wrong pooling (e.g. over padding,
    # or CLS instead of mean, which moves the vectors by ~0.1) would still fail.
    pooled = [
        F.normalize(mean_pool(features, extractor.tokenizer(s, return_tensors="pt")["attention_mask"]), dim=1)
        for s, features in zip(SENTENCES, extractor(SENTENCES, return_tensors=True), strict=True)
    ]
    ours = encode_sentences(SENTENCES)
    torch.testing.assert_close(torch.cat(pooled), ours, rtol=0, atol=1e-5)
    similarity = ours @ ours.T
    assert similarity[0, 1] > similarity[0, 2] + 0.3  # the paraphrase is closer than the cat
