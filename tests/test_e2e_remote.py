"""Workers on other machines, through real processes over TCP loopback: `gatewayctl worker`
dialing in with CURVE, its key allowed with `gatewayctl workers add`; refused keys, plain
TCP and other weights served nothing; two replicas sharing load, a conversation kept on
one, a replica killed under load (its unstarted requests go to the other), and a link that
drops under load (every request gets one whole answer or one error)."""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import zmq

from shared.protocol import PROTOCOL_VERSION, Hello
from tests.gateway_proc import GatewayProc, free_port, openai_client, running_gateway, wait_for
from tests.remote_workers import RemoteWorker, kill9, replicas
from tests.tcp_relay import relay_to

SYSTEM = "You are the assistant of a small team. Keep answers short and name your sources."


def chat_model_entry(source: Path, **engine: Any) -> dict[str, Any]:
    return {"name": "chat", "source": str(source), "engine": {"max_running": 2, **engine}}


def gateway_models(source: Path) -> list[dict[str, Any]]:
    return [{**chat_model_entry(source), "placement": "remote", "preload": False}]


def wait_ready_replicas(gw: GatewayProc, ids: list[str], timeout: float = 90) -> None:
    def ready() -> bool:
        rows = replicas(gw, "chat")
        return all(rows.get(i, {}).get("state") == "ready" for i in ids)

    wait_for(ready, timeout, f"replicas {ids} ready")


@pytest.fixture(scope="module")
def cluster(chat_model: Path) -> Iterator[tuple[GatewayProc, list[RemoteWorker]]]:
    listen = f"127.0.0.1:{free_port()}"
    with running_gateway(gateway_models(chat_model), workers_listen=listen) as gw:
        # a is allowed as people do it, with gatewayctl (the others without its start)
        workers = [
            RemoteWorker(gw, name, chat_model_entry(chat_model), by_ctl=name == "a")
            for name in ("a", "b")
        ]
        try:
            wait_ready_replicas(gw, ["chat@a", "chat@b"])
            yield gw, workers
        finally:
            for worker in workers:
                worker.stop()


def ask(client: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model="chat",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=kw.pop("max_tokens", 8),
        temperature=0,
        **kw,
    )


def test_an_allowed_worker_serves_through_the_gateway(
    cluster: tuple[GatewayProc, list[RemoteWorker]],
) -> None:
    gw, workers = cluster
    reply = ask(openai_client(gw), [{"role": "user", "content": "Hello there."}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0
    row = gw.ps()["chat"]
    assert row["state"] == "ready"
    by_id = {r["worker_id"]: r for r in row["replicas"]}
    assert {by_id["chat@a"]["key"], by_id["chat@b"]["key"]} == {"a", "b"}
    assert by_id["chat@a"]["host"] == "127.0.0.1"
    # gatewayctl shows each replica
    text = gw.ctl("ps").stdout
    assert "chat@a" in text and "chat@b" in text and "127.0.0.1" in text
    listed = gw.ctl("workers", "list", "--json").stdout
    keys = {w["name"]: w["public_key"] for w in msgspec.json.decode(listed)}
    assert keys.keys() >= {"a", "b"}
    # on its machine, `gatewayctl worker --show-key` prints the key allowed here
    assert workers[0].ctl("worker", "--show-key").stdout.strip() == keys["a"]


def test_an_unknown_key_is_refused_and_served_nothing(
    cluster: tuple[GatewayProc, list[RemoteWorker]], chat_model: Path
) -> None:
    gw, _ = cluster
    stranger = RemoteWorker(gw, "stranger", chat_model_entry(chat_model), allow=False)
    try:
        assert stranger.proc.wait(60) == 77  # refused at the handshake, before loading
    finally:
        stranger.stop()
    assert "refused this worker's key" in stranger.logs()
    assert stranger.public_key in (gw.run_dir / "gateway.log").read_text()
    assert "chat@stranger" not in replicas(gw, "chat")


def test_plain_tcp_without_curve_is_served_nothing(
    cluster: tuple[GatewayProc, list[RemoteWorker]],
) -> None:
    gw, _ = cluster
    before = replicas(gw, "chat")
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"chat@plain")
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{gw.workers_address}")
        hello = Hello("chat@plain", PROTOCOL_VERSION, 1, "chat")
        sock.send(msgspec.msgpack.encode(hello), zmq.NOBLOCK)
        assert sock.poll(1500) == 0  # nothing comes back: not even a Rejoin
    except zmq.Again:
        pass  # the handshake never completed: the frame could not even be queued
    finally:
        sock.close()
        context.term()
    assert replicas(gw, "chat").keys() == before.keys()


def test_a_worker_with_other_weights_is_refused(
    cluster: tuple[GatewayProc, list[RemoteWorker]], other_model: Path
) -> None:
    gw, _ = cluster
    impostor = RemoteWorker(gw, "impostor", chat_model_entry(other_model))
    try:
        assert impostor.proc.wait(90) == 78
    finally:
        impostor.stop()
    assert "other weights" in impostor.logs()
    assert "chat@impostor" not in replicas(gw, "chat")


def test_two_replicas_share_forty_requests(
    cluster: tuple[GatewayProc, list[RemoteWorker]],
) -> None:
    gw, _ = cluster
    before = {k: r["requests"] for k, r in replicas(gw, "chat").items()}
    client = openai_client(gw)

    def one(i: int) -> str | None:
        reply = ask(client, [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}])
        return reply.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        reasons = list(pool.map(one, range(40)))
    assert all(r in ("stop", "length") for r in reasons)
    after = {k: r["requests"] for k, r in replicas(gw, "chat").items()}
    shares = {k: after[k] - before.get(k, 0) for k in ("chat@a", "chat@b")}
    assert sum(shares.values()) == 40
    assert min(shares.values()) >= 10, shares  # each serves a fair share


def test_a_conversation_stays_on_one_replica(
    cluster: tuple[GatewayProc, list[RemoteWorker]],
) -> None:
    gw, _ = cluster
    client = openai_client(gw)
    before = {k: r["requests"] for k, r in replicas(gw, "chat").items()}
    messages = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in ["What failed first?", "Why did it fail?", "What changed?", "Is it fixed?"]:
        messages.append({"role": "user", "content": turn})
        reply = ask(client, messages, max_tokens=6)
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    after = {k: r["requests"] for k, r in replicas(gw, "chat").items()}
    served = sorted(after[k] - before.get(k, 0) for k in ("chat@a", "chat@b"))
    assert served == [0, 4]  # every turn on the same replica
    assert all(b > a for a, b in itertools.pairwise(cached)), cached


def test_a_removed_key_is_dropped(
    cluster: tuple[GatewayProc, list[RemoteWorker]], chat_model: Path
) -> None:
    gw, _ = cluster
    extra = RemoteWorker(gw, "extra", chat_model_entry(chat_model))
    try:
        wait_ready_replicas(gw, ["chat@extra"])
        gw.ctl("workers", "remove", "extra")
        wait_for(lambda: replicas(gw, "chat")["chat@extra"]["state"] == "lost", 10, "extra lost")
        assert "key was removed" in replicas(gw, "chat")["chat@extra"]["error"]
        assert extra.proc.wait(30) == 78  # told so, it leaves
    finally:
        extra.stop()


# ---- a replica killed under load ------------------------------------------------------


def long_stream(client: openai.OpenAI, content: str, max_tokens: int = 1500) -> Any:
    """A streamed greedy request that runs `max_tokens` tokens."""
    return client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def stream_until_started(client: openai.OpenAI, content: str) -> Any:
    """A long streamed request and its first chunk with text (it has started)."""
    stream = long_stream(client, content)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return stream
    raise AssertionError("the stream ended before its first token")


def finish(stream: Any) -> tuple[str, str | None]:
    """What a stream ends with: ("finish", reason) or ("error", message)."""
    try:
        reason = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return "finish", reason
    except openai.APIError as exc:
        return "error", str(exc)


def test_kill_9_of_a_replica_replays_its_unstarted_requests(
    chat_model: Path,
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    with running_gateway(gateway_models(chat_model), workers_listen=listen) as gw:
        stalls = '{"chat": {"stall_on": "STALL-HERE"}}'
        first = RemoteWorker(
            gw, "first", chat_model_entry(chat_model), env={"MLX_GATEWAY_FAULTS": stalls}
        )
        second: RemoteWorker | None = None
        try:
            wait_ready_replicas(gw, ["chat@first"])
            client = openai_client(gw, timeout=120)
            started = [stream_until_started(client, f"Tell story {i}.") for i in range(2)]
            # its engine stops once this arrives: what is queued behind it never starts
            pool = concurrent.futures.ThreadPoolExecutor(3)

            def send(text: str) -> concurrent.futures.Future[Any]:
                return pool.submit(ask, client, [{"role": "user", "content": text}], max_tokens=5)

            waiting = [send("STALL-HERE please.")]  # first: one connection keeps the order
            wait_for(lambda: gw.ps()["chat"]["in_flight"] == 3, 20, "the stall sent")
            waiting += [send("Queued one."), send("Queued two.")]
            wait_for(lambda: gw.ps()["chat"]["in_flight"] == 5, 20, "five in flight")
            second = RemoteWorker(gw, "second", chat_model_entry(chat_model))
            wait_ready_replicas(gw, ["chat@second"])
            pid = replicas(gw, "chat")["chat@first"]["pid"]
            kill9(pid)
            outcomes = [finish(s) for s in started]
            for kind, message in outcomes:  # started there: one clear error each
                assert kind == "error", outcomes
                assert "lost" in (message or "") and "had started" in (message or ""), message
            for future in waiting:  # not started: served by the other replica
                reply = future.result(timeout=120)
                assert reply.usage.completion_tokens > 0
            row = replicas(gw, "chat")["chat@first"]
            assert row["state"] == "lost" and "connection closed" in row["error"]
            assert replicas(gw, "chat")["chat@second"]["requests"] == 3
            pool.shutdown()
            # it dials in again (a new run, same id): listed as ready, not lost
            first.stop()
            first = RemoteWorker(gw, "first", chat_model_entry(chat_model), allow=False)
            wait_ready_replicas(gw, ["chat@first"])
            assert ask(client, [{"role": "user", "content": "And now?"}]).usage.completion_tokens
        finally:
            first.stop()
            if second is not None:
                second.stop()


def test_a_worker_rejoins_a_restarted_gateway(chat_model: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    first = GatewayProc(gateway_models(chat_model), workers_listen=listen)
    worker: RemoteWorker | None = None
    second: GatewayProc | None = None
    try:
        first.wait_ready([])
        worker = RemoteWorker(first, "steady", chat_model_entry(chat_model))
        wait_ready_replicas(first, ["chat@steady"])
        first.stop()
        # the same run directory and keys, the same worker port: the worker dials it again,
        # the new gateway does not know it and asks it to rejoin
        second = GatewayProc(
            gateway_models(chat_model), run_dir=str(first.run_dir), workers_listen=listen
        )
        second.wait_ready([])
        wait_ready_replicas(second, ["chat@steady"], timeout=60)
        reply = ask(openai_client(second), [{"role": "user", "content": "Still there?"}])
        assert reply.usage.completion_tokens > 0
        assert "joins the gateway again" in worker.logs()
        assert worker.proc.poll() is None  # the same run all along
    finally:
        if worker is not None:
            worker.stop()
        if second is not None:
            second.stop()
        first.stop()


def whole_or_error(client: openai.OpenAI, content: str) -> tuple[str, str]:
    """A streamed greedy answer: ("text", all of it) or ("error", the message)."""
    try:
        stream = long_stream(client, content, 600)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return "text", text
    except openai.APIError as exc:
        return "error", str(exc)


@pytest.mark.parametrize(
    "which",
    [
        pytest.param(None, id="every-connection"),
        # its output connections only (dialed after its requests socket's): the gateway can
        # still reach it, and only the worker knows tokens were lost
        pytest.param(slice(1, None), id="outputs-only"),
    ],
)
def test_a_dropped_link_loses_no_request_and_mixes_none(
    chat_model: Path, which: slice | None
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    with (
        running_gateway(gateway_models(chat_model), workers_listen=listen) as gw,
        relay_to(gw.workers_address) as relay,
    ):
        entry = chat_model_entry(chat_model, max_running=4)
        worker = RemoteWorker(gw, "flaky", entry, address=relay.address)
        try:
            wait_ready_replicas(gw, ["chat@flaky"])
            client = openai_client(gw, timeout=120)
            prompts = [f"Tell story number {i}." for i in range(6)]
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(whole_or_error, client, p) for p in prompts]
                wait_for(lambda: gw.ps()["chat"]["in_flight"] == 6, 60, "all in flight")
                cut = relay.cut(which)
                assert cut == (3 if which is None else 2)
                outcomes = [f.result(timeout=120) for f in futures]
            # it dialed in again through the relay and joined again
            wait_ready_replicas(gw, ["chat@flaky"], timeout=60)
            wait_for(lambda: relay.accepted >= 3 + cut, 30, "every connection dialed again")
            # every answer that came whole is the answer: no token lost, none twice, none
            # from a request the worker dropped
            for prompt, (kind, text) in zip(prompts, outcomes, strict=True):
                if kind == "text":
                    assert whole_or_error(client, prompt) == ("text", text)
            errors = [message for kind, message in outcomes if kind == "error"]
            assert errors, outcomes  # those running when the link dropped
            for message in errors:
                assert "was lost" in message, message
            if which is not None:  # only the worker could tell
                assert "dropped" in worker.logs() and "joins the gateway again" in worker.logs()
            kind, text = whole_or_error(client, "And now?")
            assert kind == "text", text
        finally:
            worker.stop()
