"""Regressions found by a review of the second session's shared-code changes: /score (and
/rerank) on a token classifier (an encoder NER tagger, models/bert.py) names the route that serves
it; it told the client to use /classify, which refuses a token classifier too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_engine.classification import ClassifierInfo
from paged_server.errors import APIError
from paged_server.scores import _cross_encoder


@pytest.mark.parametrize("num_labels", [1, 3])
def test_score_on_a_token_classifier_names_pooling(num_labels: int) -> None:
    labels = tuple(f"LABEL_{i}" for i in range(num_labels))
    info = ClassifierInfo(
        "BertForTokenClassification", num_labels, labels, "softmax", "softmax", per_token=True
    )
    app = SimpleNamespace(classifier=info)
    with pytest.raises(APIError) as e:
        _cross_encoder(app, None, None, "rid", [(0, 0)], None)  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.param == "model"
    assert "token classifier" in e.value.message and "/pooling" in e.value.message
    assert "/classify" not in e.value.message
