"""/v1/embeddings' body: every input shape OpenAI takes into a canonical request, the others
a 400 naming `input`; the response as floats or base64 of float32 bytes."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from gateway.api.openai.embeddings import (
    EmbeddingFormatter,
    EmbeddingRequest,
    embedding_request,
)
from gateway.api.relay import Choice
from gateway.errors import GatewayError
from shared.types import CanonicalRequest, RequestOutput, Usage


def body(value: object, **more: object) -> EmbeddingRequest:
    return EmbeddingRequest(model="m", input=value, **more)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("hi", CanonicalRequest(inputs=["hi"])),
        (["a", "b"], CanonicalRequest(inputs=["a", "b"])),
        ([1, 2, 3], CanonicalRequest(input_token_ids=[[1, 2, 3]])),
        ([[1], [2, 3]], CanonicalRequest(input_token_ids=[[1], [2, 3]])),
        # one token array longer than the list bound: one input (8k-token embedders)
        (list(range(3000)), CanonicalRequest(input_token_ids=[list(range(3000))])),
    ],
)
def test_every_input_shape(value: object, want: CanonicalRequest) -> None:
    assert embedding_request(body(value)) == want


@pytest.mark.parametrize(
    "value", [[], ["a", 1], [[1], "a"], [[1], []], [True], [-1], [1.5], [[2**31]], [None]]
)
def test_other_shapes_are_a_400_naming_input(value: object) -> None:
    with pytest.raises(GatewayError) as info:
        embedding_request(body(value))
    assert info.value.param == "input"


def test_more_inputs_than_the_bound_are_a_400() -> None:
    for value in (["a"] * 2049, [[1]] * 2049):
        with pytest.raises(GatewayError, match="at most 2048"):
            embedding_request(body(value))


def test_dimensions_go_to_the_worker_which_knows_the_model() -> None:
    assert embedding_request(body("x", dimensions=8)) == CanonicalRequest(
        inputs=["x"], dimensions=8
    )


def test_the_response_in_both_encodings() -> None:
    vectors = np.array([[0.5, -1.25], [3.0, 0.0]], dtype="<f4")
    choice = Choice(0)
    choice.add(RequestOutput("r", embeddings=vectors.tobytes(), dimensions=2))
    usage = Usage(prompt_tokens=7)
    floats = json.loads(EmbeddingFormatter("m", "float").response([choice], usage))
    assert floats == {
        "data": [
            {"index": 0, "embedding": [0.5, -1.25], "object": "embedding"},
            {"index": 1, "embedding": [3.0, 0.0], "object": "embedding"},
        ],
        "model": "m",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
        "object": "list",
    }
    raw = json.loads(EmbeddingFormatter("m", "base64").response([choice], usage))
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]]
    assert np.array_equal(np.stack(decoded), vectors)
