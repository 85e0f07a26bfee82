"""EngineCore in-process on real tiny MLX models: sampling is reproducible by seed (whatever
the batch around it) and varies without one; logit bias and the repetition, presence and
frequency penalties change the tokens chosen."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.engine_fixtures import Loaded, drive, greedy, prepared, reference_greedy, token_ids
from worker.modelgen import IM_END_ID

# Every engine test runs over each continuous batch (engine.batcher).
pytestmark = pytest.mark.usefixtures("batcher")

EOS = IM_END_ID


# ---- sampling -----------------------------------------------------------------------------


def test_seed_reproducible(chat: Loaded, prompts: list[list[int]]) -> None:
    def sample(seed: int, batch_mates: int = 0) -> list[int]:
        requests = [prepared("s", prompts[0], 16, temperature=1.0, seed=seed, ignore_eos=True)]
        requests += [greedy(f"g{i}", prompts[i + 1], 16) for i in range(batch_mates)]
        return token_ids(drive(chat.engine(), requests)["s"])

    first = sample(1)
    assert sample(1) == first
    assert sample(1, batch_mates=3) == first  # independent of the batch around it
    assert sample(2) != first
    assert sample(3) != first
    assert first != reference_greedy(chat.model, prompts[0], 16)  # it did sample


def test_unseeded_sampling_varies(chat: Loaded, prompts: list[list[int]]) -> None:
    runs = {
        tuple(
            token_ids(drive(chat.engine(), [prepared("s", prompts[0], 16, ignore_eos=True)])["s"])
        )
        for _ in range(3)
    }
    assert len(runs) > 1


def test_logit_bias_forces_a_token(chat: Loaded, prompts: list[list[int]]) -> None:
    forced = chat.tokenizer.encode("real")[0]
    out = drive(chat.engine(), [greedy("a", prompts[1], 8, logit_bias={forced: 100.0})])["a"]
    assert token_ids(out) == [forced] * 8
    # and a forbidding bias: the greedy first token never appears
    first = reference_greedy(chat.model, prompts[1], 1)[0]
    out = drive(chat.engine(), [greedy("b", prompts[1], 8, logit_bias={first: -100.0})])["b"]
    assert first not in token_ids(out)


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_change_greedy_output(
    chat: Loaded, prompts: list[list[int]], penalty: dict[str, float]
) -> None:
    # Strongly repeating: a bias makes a token of the prompt the greedy choice by one logit,
    # so without a penalty the model repeats it; a penalty over one logit must flip it.
    prompt = prompts[0]
    logits = chat.model(mx.array(prompt)[None])[0, -1]
    top = int(mx.argmax(logits).item())
    target = next(t for t in prompt if t not in (top, EOS))
    assert abs(logits[top].item()) > 4  # so a 1.5 repetition penalty moves it by > 1
    bias = {target: logits[top].item() - logits[target].item() + 1.0}
    plain = drive(chat.engine(), [greedy("p", prompt, 8, ignore_eos=True, logit_bias=bias)])
    assert token_ids(plain["p"])[0] == target
    neutral = {k: 1.0 if k == "repetition_penalty" else 0.0 for k in penalty}
    same = drive(
        chat.engine(), [greedy("n", prompt, 8, ignore_eos=True, logit_bias=bias, **neutral)]
    )
    assert token_ids(same["n"]) == token_ids(plain["p"])
    out = drive(
        chat.engine(), [greedy("q", prompt, 8, ignore_eos=True, logit_bias=bias, **penalty)]
    )
    assert token_ids(out["q"])[0] != target
    assert token_ids(out["q"]) != token_ids(plain["p"])
