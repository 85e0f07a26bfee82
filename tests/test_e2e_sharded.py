"""A model sharded over two worker processes (MLX's ring backend on loopback, tensor
parallel, and a Qwen2 pipelined), through the gateway: greedy output token for token as the
same model in one process, prefix-cache hits and a constrained answer included; one rank
killed takes the group down and the supervisor restarts it as a unit; an unload ends every
rank; NCCL without MLX's CUDA build is a 503 saying so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import openai
import psutil
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for
from tests.remote_workers import kill9

PROMPTS = ["Tell me about the sea.", "Count to five.", "What is a ring?"]


@pytest.fixture(scope="module")
def gw(chat_model: Path, qwen2_model: Path) -> Iterator[GatewayProc]:
    models = [
        {"name": "single", "source": str(chat_model)},
        {"name": "sharded", "source": str(chat_model), "shards": 2},
        {"name": "qwen2", "source": str(qwen2_model)},
        {"name": "piped", "source": str(qwen2_model), "shards": 2, "sharding": "pipeline"},
        {
            "name": "nccl",
            "source": str(chat_model),
            "shards": 2,
            "hosts": {"backend": "nccl"},
            "preload": False,
        },
    ]
    # a killed rank's group restarts after 0.2 s, not the default 1 s
    with running_gateway(models, request_timeout_s=60.0, restart_backoff_s=0.2) as gateway:
        yield gateway


def greedy(client: openai.OpenAI, model: str, prompt: str) -> Any:
    return client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )


def tokens(reply: Any) -> list[str]:
    return list(reply.choices[0].logprobs.tokens)


@pytest.mark.parametrize(("single", "sharded"), [("single", "sharded"), ("qwen2", "piped")])
def test_greedy_output_is_the_single_process_models(
    gw: GatewayProc, single: str, sharded: str
) -> None:
    client = openai_client(gw)
    for prompt in PROMPTS:
        one, two = greedy(client, single, prompt), greedy(client, sharded, prompt)
        assert tokens(two) == tokens(one) and len(tokens(one)) == 24
        assert two.choices[0].text == one.choices[0].text
    # a conversation's second turn from each rank's prefix cache: still the same tokens
    messages = [
        {"role": "system", "content": "You answer in short sentences about the weather."},
        {"role": "user", "content": "Hi"},
    ]
    for turn in range(2):
        reply = {
            model: client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
            )
            for model in (single, sharded)
        }
        text = reply[single].choices[0].message.content
        assert reply[sharded].choices[0].message.content == text
        cached = reply[sharded].usage.prompt_tokens_details
        assert (cached.cached_tokens if cached else 0) > 0 or turn == 0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
    # a constrained answer: every rank's guide alike, the same JSON as one process's
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    constrained = {
        model: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "A number, please."}],
            max_tokens=16,
            temperature=0,
            response_format=fmt,  # type: ignore[arg-type]
        )
        for model in (single, sharded)
    }
    text = constrained[single].choices[0].message.content
    assert constrained[sharded].choices[0].message.content == text
    if constrained[single].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text or "")["n"], int)
    if sharded == "piped":  # each rank ran its own layers (mlx-lm's pipeline), not a slice
        log = (gw.run_dir / "logs" / "worker-piped.log").read_text()
        assert "pipeline rank 0 of 2: layers 1-2" in log
        assert "pipeline rank 1 of 2: layers 0-0" in log
    row = gw.ps()[sharded]
    (replica,) = row["replicas"]
    assert len(replica["ranks"]) == 2 and replica["ranks"][0] == row["pid"]
    assert all(psutil.pid_exists(pid) for pid in replica["ranks"])


def test_a_killed_rank_restarts_the_group(gw: GatewayProc) -> None:
    client = openai_client(gw)
    before = gw.ps()["sharded"]
    ranks = before["replicas"][0]["ranks"]
    kill9(ranks[1])

    def restarted() -> bool:
        row = gw.ps()["sharded"]
        return row["restarts"] > before["restarts"] and row["state"] == "ready"

    wait_for(restarted, 90, "the group restarted")
    row = gw.ps()["sharded"]
    assert "rank 1 of its 2-process group exited (killed by SIGKILL)" in row["last_error"]
    new_ranks = row["replicas"][0]["ranks"]
    assert not set(new_ranks) & set(ranks)
    assert not any(psutil.pid_exists(pid) for pid in ranks)  # the old group is gone whole
    one = greedy(client, "single", PROMPTS[0])
    assert tokens(greedy(client, "sharded", PROMPTS[0])) == tokens(one)


def test_an_unload_ends_every_rank(gw: GatewayProc) -> None:
    ranks = gw.ps()["sharded"]["replicas"][0]["ranks"]
    gw.unload("sharded")
    assert gw.ps()["sharded"]["state"] == "unloaded"
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in ranks), 20, "ranks gone")


@pytest.mark.skipif(
    mx.distributed.is_available("nccl"), reason="this MLX has NCCL: the group would form"
)
def test_nccl_without_mlxs_cuda_build_fails_the_load_saying_so(gw: GatewayProc) -> None:
    # both ranks start (a GPU each, rank 0's port): the group's init is what this MLX lacks
    with pytest.raises(openai.APIStatusError) as failed:
        greedy(openai_client(gw), "nccl", PROMPTS[0])
    assert failed.value.status_code == 503
    assert "hosts.backend = 'nccl' needs MLX's CUDA build" in str(failed.value)
