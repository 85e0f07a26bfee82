"""worker/vision/prompt.py without a model: the prefix cache's key of a prompt with images,
and images that are not images."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from shared.types import ImagePart
from worker.preprocess import PreprocessError
from worker.vision.prompt import LOW_DETAIL_SIDE, content_key, decode

PAD, VOCAB = 5, 100


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


RED, BLUE = png((255, 0, 0)), png((0, 0, 255))
PROMPT = [1, 2, 3, PAD, PAD, PAD, 4, 7, 8, 3, PAD, PAD, 4, 9]  # two images of 3 and 2 tokens


def test_image_tokens_are_keyed_past_the_vocabulary_and_text_is_kept() -> None:
    key = content_key(PROMPT, PAD, [RED, BLUE], VOCAB)
    assert len(key) == len(PROMPT)
    for token, keyed in zip(PROMPT, key, strict=True):
        if token == PAD:
            assert keyed >= VOCAB
        else:
            assert keyed == token
    images = [k for k in key if k >= VOCAB]
    assert len(set(images)) == len(images)  # each place of each image its own id


def test_the_same_images_give_the_same_key() -> None:
    assert content_key(PROMPT, PAD, [RED, BLUE], VOCAB) == content_key(
        PROMPT, PAD, [png((255, 0, 0)), png((0, 0, 255))], VOCAB
    )


def test_another_image_diverges_at_its_first_token_only() -> None:
    first = content_key(PROMPT, PAD, [RED, BLUE], VOCAB)
    second = content_key(PROMPT, PAD, [RED, RED], VOCAB)
    diverge = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    assert diverge == PROMPT.index(PAD, 6)  # the second image's first token
    swapped = content_key(PROMPT, PAD, [BLUE, BLUE], VOCAB)
    assert swapped[:3] == first[:3] and swapped[3] != first[3]


def test_images_side_by_side_are_keyed_by_all_of_them() -> None:
    adjacent = [1, PAD, PAD, PAD, PAD, 2]  # two images, one run of tokens
    key = content_key(adjacent, PAD, [RED, BLUE], VOCAB)
    other = content_key(adjacent, PAD, [RED, RED], VOCAB)
    assert key[0] == other[0] == 1
    assert key[1] != other[1]  # not reused from the first image on: it cannot be told apart


def test_a_prompt_without_image_tokens_is_its_own_key() -> None:
    assert content_key([1, 2, 3], PAD, [], VOCAB) == [1, 2, 3]


def test_decode_gives_rgb_and_low_detail_shrinks() -> None:
    image = decode(ImagePart(png((1, 2, 3), (1500, 700))), "x")
    assert image.mode == "RGB" and image.size == (1500, 700)
    low = decode(ImagePart(png((1, 2, 3), (1500, 700)), detail="low"), "x")
    assert max(low.size) == LOW_DETAIL_SIDE


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        (
            ImagePart(b"not an image", where="messages[0].content[1].image_url.url"),
            "messages[0].content[1].image_url.url",
            "not an image that can be decoded",
        ),
        (
            ImagePart(png((0, 0, 0))[:40], where="messages[2].content[0].source"),
            "messages[2].content[0].source",
            "not an image that can be decoded",
        ),
        (
            ImagePart(url="https://example.com/a.png", where="input[0].content[0].image_url"),
            "input[0].content[0].image_url",
            "was not fetched",
        ),
        (ImagePart(RED, detail="ultra", where="m"), "m.detail", "detail must be one of"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(part: ImagePart, param: str, words: str) -> None:
    with pytest.raises(PreprocessError) as caught:
        decode(part, part.where or "?")
    assert caught.value.error.param == param
    assert words in caught.value.error.message
